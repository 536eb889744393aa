"""mtpjax/xla_cpu.py: the engine's own XLA:CPU settings go into XLA_FLAGS before the backend
starts, never over the user's own value of a flag, and not at all when switched off, on
another platform, or too late (pure: a dict stands in for the environment)."""

from mtpjax import xla_cpu

FLAGS = ("--xla_cpu_use_thunk_runtime=false", "--xla_cpu_multi_thread_eigen=false")


def test_chosen_flags_are_added_before_the_backend_starts():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_cpu.apply(env, FLAGS, backend_started=False)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *FLAGS]
    assert not xla_cpu.apply(env, FLAGS, backend_started=False)     # idempotent


def test_the_users_value_wins_and_the_switches_are_honoured():
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}
    assert xla_cpu.apply(env, FLAGS, backend_started=False)
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_multi_thread_eigen=true", FLAGS[0]]
    for env in ({xla_cpu.ENV_OFF: "none"}, {"JAX_PLATFORMS": "cuda"}):
        assert not xla_cpu.apply(env, FLAGS, backend_started=False) and "XLA_FLAGS" not in env
    env = {}
    assert not xla_cpu.apply(env, FLAGS, backend_started=True) and env == {}
    assert not xla_cpu.apply({}, (), backend_started=False)          # nothing chosen


def test_every_candidate_names_real_xla_flags():
    """Each candidate's flags exist in this jaxlib (a misspelt flag makes XLA abort at start)."""
    import glob
    import os
    import jaxlib
    blobs = b"".join(open(p, "rb").read() for p in
                     glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "*.so")))
    for name, flags in xla_cpu.CANDIDATES.items():
        for f in flags:
            assert xla_cpu._name(f).encode() in blobs, (name, f)
    assert set(xla_cpu.CHOSEN) <= {f for fl in xla_cpu.CANDIDATES.values() for f in fl}
