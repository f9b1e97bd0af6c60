"""lmkit: what the built-in language-model templates (bert, gpt2) share rather than copy: the training program
around an `Objective` (trainer.py), the config file's schema with its trainer and runtime sections (config.py),
the prepared data's manifest (manifest.py), its tf.data reader (shards.py) and the laptop's prepare pipeline and
upload (prepare.py), Hugging Face export helpers (hf_export.py), Keras layers, losses, optimizer and learning-rate
schedule (layers.py), the strategy on TPU / GPU / CPU for TensorFlow or JAX and the TPU VM guest (strategy.py,
guest.py), backend-neutral checkpoints (checkpoints.py, portable.py), the progress callback and notices
(callbacks.py) and the errors a template raises (errors.py).

Not a template (no template.json): installed it is `tpuctl.templates.lmkit`; a job bundle ships it beside the
template that lists it in template.json `uses`, as the top-level package `lmkit`. A template imports it through
its `shared.py` (templates/README.md "Building on lmkit").
"""
