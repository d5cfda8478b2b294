"""The device communicators' own timeouts follow rl_config.collective_timeout_s (execution)
and the start-up bound (connect)."""

from __future__ import annotations


def test_hccl_timeouts_follow_collective_timeout_unless_exported():
    from mindspeed_rl.parallel.groups import communicator_env

    env = {}
    assert communicator_env(600, env) == {"HCCL_CONNECT_TIMEOUT": "600",
                                          "HCCL_EXEC_TIMEOUT": "600"}
    env = {"HCCL_EXEC_TIMEOUT": "99"}
    communicator_env(10, env)  # below HCCL's connect minimum: clamped; the export kept
    assert env == {"HCCL_EXEC_TIMEOUT": "99", "HCCL_CONNECT_TIMEOUT": "120"}
    env = {}
    communicator_env(86400, env)
    assert env == {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "17340"}
    env = {}
    communicator_env(10, env, connect_s=600)  # communicators connect during start-up
    assert env == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "10"}
