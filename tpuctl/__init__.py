"""tpuctl: from a laptop to a trained model on Cloud TPUs and back to a zero bill."""

__version__ = "0.1.0"
