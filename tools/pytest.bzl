"""`py_pytest_test`: a py_test that runs its test files with pytest.

    load("//tools:pytest.bzl", "py_pytest_test")

    py_pytest_test(
        name = "test_schedule",
        srcs = ["test_schedule.py"],
        deps = ["//rtp_llm/models_py/modules/hybrid/topology_kv"],
    )

Only srcs named test_*.py or *_test.py are handed to pytest (all srcs if none is); put
helpers in a py_library and list it in deps. `args` are extra pytest arguments, and so is
`bazel test --test_arg=...` (e.g. --test_arg=-k --test_arg=decode).
GPU variants: `cpu_and_cuda_pytest` below makes the CPU target and its `<base>_cuda_manual`
twin, which runs the same files with TOPOLOGY_KV_TEST_DEVICE=cuda (tools/device_under_test.py),
tagged `manual` (so `bazel test //...` skips it) and with the GPU name, as RTP-LLM tags its
GPU tests.
"""

_RUNNER = "//tools:pytest_runner.py"

# The interpreter's package list (tools/python_toolchain.bzl): a change in the venv
# changes every test's inputs, so cached results are not reused.
_PACKAGES = "@rtp_llm_python//:installed_packages"

def _is_test_file(src):
    base = src.split(":")[-1].split("/")[-1]
    return base.endswith(".py") and (base.startswith("test_") or base.endswith("_test.py"))

def py_pytest_test(name, srcs, deps = [], data = [], tags = [], size = "medium", args = [], **kwargs):
    test_files = [s for s in srcs if _is_test_file(s)] or srcs
    native.py_test(
        name = name,
        srcs = [_RUNNER] + srcs,
        main = _RUNNER,
        args = ["$(rootpath %s)" % s for s in test_files] + ["--"] + args,
        deps = deps,
        data = data + ["//:pytest.ini", _PACKAGES],
        tags = tags,
        size = size,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def cpu_and_cuda_pytest(name, cuda_name, srcs, deps = [], data = [], size = "medium", gpu = "H20"):
    """`py_pytest_test` on the CPU plus its `cuda_name` twin (manual, GPU-tagged)."""
    deps = deps + ["//tools:device_under_test"]
    srcs = srcs + native.glob(["conftest.py"])  # the calling package's shared fixtures
    py_pytest_test(name = name, srcs = srcs, deps = deps, data = data, size = size)
    py_pytest_test(
        name = cuda_name,
        srcs = srcs,
        deps = deps,
        data = data,
        size = size,
        env = {"TOPOLOGY_KV_TEST_DEVICE": "cuda"},
        tags = ["manual", gpu],
    )
