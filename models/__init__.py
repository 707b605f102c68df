"""Model definitions; each model keeps its maths single-device and its parallel wiring apart."""
