"""The embedded local cloud: TPU, Compute, Resource Manager and Storage emulation on 127.0.0.1."""
