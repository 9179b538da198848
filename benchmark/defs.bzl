"""`cpu_and_cuda_pytest`: one test target on CPU plus its `<base>_cuda_manual` GPU twin.

The twin runs the same files with TOPOLOGY_KV_TEST_DEVICE=cuda, tagged `manual` (so
`bazel test //...` skips it) and with the GPU name, as RTP-LLM tags its GPU tests.
"""

load("//tools:pytest.bzl", "py_pytest_test")

def cpu_and_cuda_pytest(name, cuda_name, srcs, deps = [], data = [], size = "medium", gpu = "H20"):
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
