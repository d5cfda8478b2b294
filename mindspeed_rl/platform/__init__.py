"""Device platform: detection, collective backend, and megatron adaptors per device."""

from mindspeed_rl.platform.platform import Platform, PlatformError, setup_platform

__all__ = ["Platform", "PlatformError", "setup_platform"]
