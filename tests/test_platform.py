"""Platform detection and the CPU adaptor's scope: plain torch must stay plain torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mindspeed_rl.platform import setup_platform


def _run_python(code: str, env: dict[str, str] | None = None, pythonpath: str | None = None,
                without: tuple[str, ...] = ()):
    full_env = {k: v for k, v in dict(os.environ, **(env or {})).items() if k not in without}
    if pythonpath:
        full_env["PYTHONPATH"] = pythonpath + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_platform_and_plain_torch_untouched():
    platform = setup_platform()
    assert (platform.device_type, platform.backend) == ("cpu", "gloo")
    assert setup_platform() is platform  # idempotent
    import megatron.core.tensor_parallel.layers as layers  # noqa: F401 - rebound module

    # Outside megatron, torch behaves as a CPU build always does.
    assert torch.zeros(3).type() == "torch.FloatTensor"
    assert torch.cuda.is_available() is False
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(3, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(3).cuda()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    # Inside megatron, the same calls are mapped to CPU.
    assert layers.torch is not torch and layers.torch.cuda.current_device() == "cpu"
    assert layers.torch.zeros(2, device="cuda").device.type == "cpu"
    assert layers.torch.Tensor is torch.Tensor and layers.torch.float32 is torch.float32


def test_megatron_modules_see_cuda_types_only_from_megatron():
    setup_platform()
    from megatron.core.optimizer import clip_grads

    assert clip_grads.torch is not torch
    # Tensor.type() answers megatron callers with CUDA type names (its fp32 checks) ...
    probe = {"__name__": "megatron.core.optimizer.clip_grads"}
    assert eval("x.type()", probe, {"x": torch.zeros(1)}) == "torch.cuda.FloatTensor"
    # ... and everyone else with the truth.
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.zeros(1, dtype=torch.float64).type(torch.float32).dtype == torch.float32


def test_broken_torch_npu_names_the_failed_import(tmp_path):
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libascendcl.so: cannot open shared object file')\n")
    proc = _run_python(
        """
        from mindspeed_rl.platform import PlatformError, setup_platform
        try:
            setup_platform()
        except PlatformError as exc:
            print("ERR", exc)
        """, pythonpath=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "ERR `import torch_npu` failed" in proc.stdout
    assert "libascendcl.so" in proc.stdout and "set_env.sh" in proc.stdout


def _transparent_huge_pages_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_forced_device_env():
    """MINDSPEED_RL_DEVICE=cpu skips detection. On CPU, setup_platform also sets PyTorch's
    THP_MEM_ALLOC_ENABLE=1 before any large allocation (docs/performance.md: page faults of
    4 KiB pages made allocating big tensors several times slower): a 64 MiB tensor then
    lies in 2 MiB pages where the kernel offers them."""
    proc = _run_python(
        """
        import os, torch
        from mindspeed_rl.platform import setup_platform
        print(setup_platform())
        x = torch.ones(16 * 2**20)  # 64 MiB, every page touched
        rollup = open("/proc/self/smaps_rollup").read().splitlines()
        huge = [int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")]
        print("ENV", os.environ.get("THP_MEM_ALLOC_ENABLE"), "HUGE_KB", huge[0])
        """, env={"MINDSPEED_RL_DEVICE": "cpu"}, without=("THP_MEM_ALLOC_ENABLE",))
    assert "device_type='cpu'" in proc.stdout, proc.stderr
    _, env, _, huge_kb = proc.stdout.split()[-4:]
    assert env == "1"
    if _transparent_huge_pages_offered():
        assert int(huge_kb) >= 32 * 1024
    proc = _run_python(
        """
        from mindspeed_rl.platform import PlatformError, setup_platform
        try:
            setup_platform()
        except PlatformError as exc:
            print("ERR", exc)
        """, env={"MINDSPEED_RL_DEVICE": "tpu"})
    assert "MINDSPEED_RL_DEVICE='tpu' is not a device" in proc.stdout, proc.stderr


@pytest.mark.parametrize("device_type,backend", [("cuda", "nccl"), ("npu", "hccl"),
                                                 ("cpu", "gloo")])
def test_world_group_reduces_cpu_tensors_on_every_platform(device_type, backend):
    """The trainer reduces metric sums, stop flags and counts as CPU tensors on the world
    group; NCCL or HCCL alone has no backend for them."""
    import torch.distributed as dist

    from mindspeed_rl.platform.platform import Platform

    config = Platform(device_type, backend).process_group_backend
    devices = dist.BackendConfig(dist.Backend(config)).get_device_backend_map()
    assert devices["cpu"] == "gloo"
    if device_type != "cpu":
        assert devices[device_type] == backend
