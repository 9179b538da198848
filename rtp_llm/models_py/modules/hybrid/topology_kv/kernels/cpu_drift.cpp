// A decode step's indexer-key write and the block drift tracker's update in one C++ call.
//
// Same semantics as BlockDriftTracker.update_reference (drift.py is the specification);
// the Python wrapper (cpu_drift.py) checks metadata and hands over fp32 contiguous keys.
// Everything is validated before anything is written, so an error leaves the pool and the
// tracker unchanged. Two passes over the T new keys:
//
//  1. per key, in order: store it at its pool slot (converted to the pool's dtype, as
//     Tensor.to rounds), add it to its block's running sum and count (column N, the dump,
//     for a position < 0 or past capacity); the adds run in key order, as index_add_ does;
//  2. per key, for its block and the next one (1 <= block < N): the drift between that
//     block's and the previous block's centroid (sum / count in fp32) once both hold
//     block_size keys, else 0. The distance is drift.py's rule: fp32 centroid differences,
//     their squares (cosine: products) accumulated in fp64 in index order, sqrt in fp64,
//     rounded once to fp32. Products of fp32 values are exact in fp64, so neither FMA
//     contraction nor the compiler can change a bit.

#include <torch/python.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline int64_t read_int(const torch::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i * t.stride(0)]
                                      : int64_t(t.data_ptr<int32_t>()[i * t.stride(0)]);
}

inline int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

template <typename pool_t>
void store_rows(const float* keys, int64_t T, int64_t K, pool_t* pool, int64_t pool_stride,
                const int64_t* slots) {
  for (int64_t t = 0; t < T; ++t) {
    pool_t* dst = pool + slots[t] * pool_stride;
    const float* src = keys + t * K;
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<pool_t>(src[k]);
  }
}

// Distance of centroid `cur` from `prev` (both sums over `count` keys), drift.py's rule.
inline float pair_drift(const float* sum_prev, float count_prev, const float* sum_cur, float count_cur,
                        int64_t K, bool cosine) {
  double a2 = 0.0, b2 = 0.0, ab = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const float p = sum_prev[k] / count_prev;
    const float c = sum_cur[k] / count_cur;
    if (cosine) {
      a2 += double(c) * double(c);
      b2 += double(p) * double(p);
      ab += double(c) * double(p);
    } else {
      const float d = c - p;
      a2 += double(d) * double(d);
    }
  }
  if (!cosine) return static_cast<float>(std::sqrt(a2));
  const double denom = std::sqrt(std::fmax(a2 * b2, 1e-24));  // eps = 1e-12, squared; NaN -> eps
  return static_cast<float>(1.0 - ab / denom);
}

void track(torch::Tensor keys, torch::Tensor positions, c10::optional<torch::Tensor> request_ids,
           torch::Tensor sums, torch::Tensor counts, torch::Tensor drift, int64_t block_size, bool cosine,
           c10::optional<torch::Tensor> pool, c10::optional<torch::Tensor> slots) {
  // keys [T, ...] with K values per token (e.g. [T, K] or [T, 1, K]): read flat, no reshape.
  const int64_t B = sums.size(0), N = sums.size(1) - 1, K = sums.size(2);
  const int64_t T = keys.dim() == 0 ? 0 : keys.size(0);
  TORCH_CHECK(keys.is_contiguous() && keys.scalar_type() == at::kFloat && keys.dim() >= 1 && keys.numel() == T * K,
              "keys: expected fp32 contiguous [T, ...] with ", K, " values per token, got ", keys.scalar_type(), " ",
              keys.sizes());
  TORCH_CHECK(sums.is_contiguous() && counts.is_contiguous() && drift.is_contiguous(),
              "tracker state: expected contiguous tensors");
  // Validate every index before the first write.
  std::vector<int64_t> req(T), blk(T), slot;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = request_ids.has_value() ? read_int(*request_ids, t) : 0;
    TORCH_CHECK(r >= 0 && r < B, "request_ids: expected values in [0, ", B, "), got ", r, " at index ", t);
    req[t] = r;
    const int64_t p = read_int(positions, t);
    const int64_t b = p < 0 ? N : floor_div(p, block_size);
    blk[t] = b < N ? b : N;
  }
  if (pool.has_value()) {
    const int64_t S = pool->size(0);
    slot.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      int64_t s = read_int(*slots, t);
      if (s < 0) s += S;  // as tensor indexing reads a negative index
      TORCH_CHECK(s >= 0 && s < S, "slot_mapping: expected values in [-", S, ", ", S, "), got ",
                  read_int(*slots, t), " at index ", t);
      slot[t] = s;
    }
  }
  // Pass 1: the pool rows, the running sums and counts, in key order.
  const float* kp = keys.data_ptr<float>();
  if (pool.has_value()) {
    const int64_t ps = pool->stride(0);
    switch (pool->scalar_type()) {
      case at::kFloat: store_rows(kp, T, K, pool->data_ptr<float>(), ps, slot.data()); break;
      case at::kDouble: store_rows(kp, T, K, pool->data_ptr<double>(), ps, slot.data()); break;
      case at::kHalf: store_rows(kp, T, K, pool->data_ptr<at::Half>(), ps, slot.data()); break;
      case at::kBFloat16: store_rows(kp, T, K, pool->data_ptr<at::BFloat16>(), ps, slot.data()); break;
      default: TORCH_CHECK(false, "pool: unsupported dtype ", pool->scalar_type());
    }
  }
  float* sp = sums.data_ptr<float>();
  float* cp = counts.data_ptr<float>();
  float* dp = drift.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lin = req[t] * (N + 1) + blk[t];
    float* dst = sp + lin * K;
    const float* src = kp + t * K;
    for (int64_t k = 0; k < K; ++k) dst[k] += src[k];
    cp[lin] += 1.0f;
  }
  // Pass 2: drift of each touched block and its successor, from the final state.
  const float full = static_cast<float>(block_size);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t target = blk[t]; target <= blk[t] + 1; ++target) {
      if (target < 1 || target >= N) continue;
      const int64_t cur = req[t] * (N + 1) + target, prev = cur - 1;
      float value = 0.0f;
      if (cp[prev] == full && cp[cur] == full)
        value = pair_drift(sp + prev * K, cp[prev], sp + cur * K, cp[cur], K, cosine);
      dp[req[t] * N + target] = value;
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("track", &track, "indexer key write + block drift tracker update (see cpu_drift.py)");
}
