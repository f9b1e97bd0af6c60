"""lmkit: what the built-in language-model templates (bert, gpt2) share rather than copy: Keras layers, losses and
optimizer (layers.py), the strategy on TPU / GPU / CPU for TensorFlow or JAX and the TPU VM guest (strategy.py,
guest.py), backend-neutral checkpoints (checkpoints.py, portable.py), the progress callback and notices
(callbacks.py) and the errors a template raises (errors.py).

Not a template (no template.json): installed it is `tpuctl.templates.lmkit`; a job bundle ships it beside the
template that lists it in template.json `uses`, as the top-level package `lmkit`.
"""
