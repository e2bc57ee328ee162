"""jaxsoft's training loop: ``.venv/bin/python train/train.py --preset smoke --workdir DIR``.

Modules: config (dataclass, presets, CLI), model (decoder LM with jaxsoft attention), layers
(the linear and sparse attention layers of hybrid stacks), sample (generation from a checkpoint
with KV caches and recurrent states), data
(pydoc_data corpus and synthetic probes), sharding (mesh, layouts), checkpoint (orbax), metrics
(jsonl, tqdm, comparison table/plot) and train (the entry point and the train step).
"""
