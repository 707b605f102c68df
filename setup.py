"""Installs core/, models/, data/ and tools/, and builds the C++ extension ``data._csrc``.

The extension is required: if it does not compile, the install fails with the compiler's
error (Megatron builds its helpers optionally and users find out at training time).
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext_modules = [
    Pybind11Extension(
        "data._csrc",
        ["csrc/pack_planner.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(
    name="step37-trainer",
    version="0.1.0",
    description="Megatron-style trainer for Step-3.7 MoE models on packed THD sequences",
    python_requires=">=3.10",
    packages=find_packages(include=["core", "core.*", "models", "models.*", "data", "data.*", "training",
                                    "tools", "tools.*"]),
    py_modules=["pretrain_step37", "train_args"],
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "torch>=2.11",  # varlen_attn, grouped_mm, FSDP2; what differs up to 2.13 is feature-detected (the Makefile installs the CPU 2.13 first when no torch is importable)
        "numpy>=1.24",
        "tqdm>=4.60",
        "tensorboard>=2.10",
    ],
    extras_require={
        "hf": ["transformers>=5.24", "tokenizers>=0.20", "safetensors>=0.4"],
        # Parquet / Arrow / datasets.save_to_disk inputs of tools/preprocess_data.py (datasets
        # itself is never needed: pyarrow reads its folders)
        "data": ["pyarrow>=15"],
        # make quickstart: trains a BPE tokenizer (tokenizers) and draws the loss curve (matplotlib)
        "quickstart": ["tokenizers>=0.20", "matplotlib>=3.7"],
        "sentencepiece": ["sentencepiece>=0.2", "protobuf>=3.20"],
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "transformers>=5.24",
                 "tokenizers>=0.20", "safetensors>=0.4", "sentencepiece>=0.2", "protobuf>=3.20", "psutil>=5", "tensorboard>=2.10",
                 "matplotlib>=3.7", "pyarrow>=15", "peft>=0.21"],
        "te": ["transformer-engine[pytorch]"],
    },
)
