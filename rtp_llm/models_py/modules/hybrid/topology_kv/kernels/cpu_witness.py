"""``query_group_mass`` witness scores as one C++ call (CPU tensors).

:func:`query_group_mass_cpu` computes what
:func:`~rtp_llm.models_py.modules.hybrid.topology_kv.witness.tracker_query_group_mass_scores_reference`
(the specification) computes: each row's pooled query per KV head against its own
request's block key centroids, a softmax over the row's eligible blocks per KV head,
summed over the KV heads. The reference gathers an ``[R, N, Hkv, D]`` table and multiplies
it elementwise; the kernel reads each row's request table once where it lies, rows in
parallel. Equal to the reference up to fp32 rounding (another summation order). The C++
source is ``cpu_witness.cpp``, compiled on first use and cached
(:class:`~.cpp_extension.CppKernel`).

Every index is checked before any work (``RuntimeError`` naming the argument).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpp_extension import CppKernel
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_drift import index_tensor

_KERNEL = CppKernel("topology_kv_witness_cpu", "cpu_witness.cpp", cflags=["-O3", "-fopenmp"], ldflags=["-fopenmp"])


def can_use_witness_kernel(device: Union[torch.device, str]) -> bool:
    """Whether :func:`query_group_mass_cpu` can run on ``device`` (CPU and a working build); never raises."""
    return _KERNEL.available(device)


def build_error() -> Optional[str]:
    """Why the extension did not build (after a failed :func:`can_use_witness_kernel`), or None."""
    return _KERNEL.build_error()


def query_group_mass_cpu(
    queries: torch.Tensor,
    block_sums: torch.Tensor,
    block_counts: torch.Tensor,
    row_to_request: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """float32 ``[R, N]`` scores; the arguments as in
    :func:`~rtp_llm.models_py.modules.hybrid.topology_kv.witness.tracker_query_group_mass_scores`
    (``block_sums`` and ``block_counts`` float32, any strides; queries of any float dtype,
    read as fp32). Raises RuntimeError naming the argument for a shape, dtype or index the
    kernel cannot take."""
    return _KERNEL.load().query_group_mass(
        queries.to(torch.float32).contiguous(), block_sums, block_counts, index_tensor(row_to_request),
        index_tensor(lengths), int(block_size))
