"""Context parallelism: each pack split over the CP group (``shard.py``), attention exact across
the shards (``plan.py``, ``exchange.py``, ``attention.py``), and the parallelize step that wires
a chunk to the CP group (``apply.py``)."""
