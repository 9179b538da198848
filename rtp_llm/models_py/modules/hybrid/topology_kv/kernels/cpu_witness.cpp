// query_group_mass witness scores of every row against its own request's block key
// centroids, in one C++ pass per row (rows in parallel).
//
// Same semantics as witness.tracker_query_group_mass_scores_reference (the specification);
// the Python wrapper (cpu_witness.py) checks metadata and hands over fp32 queries. Per row r
// of request b = rows[r], with G = H / Hkv query heads per KV head:
//
//   qbar[g]      = mean of the G query heads that read KV head g         (fp32)
//   logit[g, n]  = (sum_d qbar[g, d] * sums[b, n, g D + d]) / max(counts[b, n], 1)
//   out[r, n]    = sum_g softmax_n(logit[g, :])[n]   for n < ceil(lengths[r] / block_size)
//   out[r, n]    = 0                                 for the other blocks
//
// The reference forms the centroid table with a gather and an elementwise product per row;
// this reads each row's request table once, as it lies (any strides), and keeps the logits
// of one row in a scratch buffer. Results match the reference to fp32 rounding (the sums are
// accumulated in another order), not bit for bit.

#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline int64_t read_int(const torch::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i * t.stride(0)]
                                      : int64_t(t.data_ptr<int32_t>()[i * t.stride(0)]);
}

// Dot product of two fp32 vectors of length D with eight partial sums (vectorizes without
// -ffast-math).
inline float dot(const float* a, const float* b, int64_t D) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

void score_row(const float* q, int64_t H, int64_t Hkv, int64_t D, const float* sums, int64_t sum_n_stride,
               int64_t sum_k_stride, const float* counts, int64_t count_stride, int64_t n_blocks, int64_t N,
               float* out, std::vector<float>& qbar, std::vector<float>& logits, std::vector<float>& table) {
  const int64_t G = H / Hkv;
  const int64_t K = Hkv * D;
  for (int64_t g = 0; g < Hkv; ++g) {
    for (int64_t d = 0; d < D; ++d) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += q[(g * G + j) * D + d];
      qbar[g * D + d] = s / static_cast<float>(G);
    }
  }
  for (int64_t n = 0; n < n_blocks; ++n) {
    const float* row = sums + n * sum_n_stride;
    if (sum_k_stride != 1) {  // a strided table: copy the block's K values once
      for (int64_t k = 0; k < K; ++k) table[k] = row[k * sum_k_stride];
      row = table.data();
    }
    const float inv = 1.0f / std::max(counts[n * count_stride], 1.0f);
    for (int64_t g = 0; g < Hkv; ++g) logits[g * n_blocks + n] = dot(qbar.data() + g * D, row + g * D, D) * inv;
  }
  std::fill(out, out + N, 0.0f);
  for (int64_t g = 0; g < Hkv; ++g) {
    float* l = logits.data() + g * n_blocks;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < n_blocks; ++n) m = std::max(m, l[n]);
    float total = 0.f;
    for (int64_t n = 0; n < n_blocks; ++n) {
      l[n] = std::exp(l[n] - m);
      total += l[n];
    }
    const float inv_total = 1.0f / total;
    for (int64_t n = 0; n < n_blocks; ++n) out[n] += l[n] * inv_total;
  }
}

torch::Tensor query_group_mass(const torch::Tensor& queries, const torch::Tensor& sums, const torch::Tensor& counts,
                               const torch::Tensor& rows, const torch::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(queries.device().is_cpu() && sums.device().is_cpu() && counts.device().is_cpu() &&
                  rows.device().is_cpu() && lengths.device().is_cpu(),
              "query_group_mass: every tensor must be on the CPU");
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.is_contiguous(),
              "queries: expected contiguous float32 [R, H, D], got ", queries.scalar_type(), " of shape ",
              queries.sizes());
  TORCH_CHECK(sums.dim() == 3 && sums.scalar_type() == at::kFloat,
              "block_sums: expected float32 [B, N, Hkv * D], got ", sums.scalar_type(), " of shape ", sums.sizes());
  const int64_t R = queries.size(0), H = queries.size(1), D = queries.size(2);
  const int64_t B = sums.size(0), N = sums.size(1), K = sums.size(2);
  TORCH_CHECK(D > 0 && K % D == 0 && K / D > 0 && H % (K / D) == 0, "block_sums: expected [B, N, Hkv * ", D,
              "] with Hkv dividing ", H, " query heads, got shape ", sums.sizes());
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == B && counts.size(1) == N && counts.scalar_type() == at::kFloat,
              "block_counts: expected float32 [", B, ", ", N, "], got ", counts.scalar_type(), " of shape ",
              counts.sizes());
  for (const auto* t : {&rows, &lengths}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R &&
                    (t->scalar_type() == at::kLong || t->scalar_type() == at::kInt),
                t == &rows ? "row_to_request" : "lengths", ": expected int32 or int64 [", R, "], got ",
                t->scalar_type(), " of shape ", t->sizes());
  }
  TORCH_CHECK(block_size > 0, "block_size: expected > 0, got ", block_size);
  for (int64_t r = 0; r < R; ++r) {  // every index checked before any work
    const int64_t b = read_int(rows, r);
    TORCH_CHECK(b >= 0 && b < B, "row_to_request: expected values in [0, ", B, "), got ", b, " at row ", r);
    const int64_t len = read_int(lengths, r);
    TORCH_CHECK(len > 0, "lengths: expected > 0, got ", len, " at row ", r);
  }
  auto out = torch::empty({R, N}, queries.options());
  if (R == 0 || N == 0) return out;
  const int64_t Hkv = K / D;
  const float* q = queries.data_ptr<float>();
  const float* s = sums.data_ptr<float>();
  const float* c = counts.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbar(Hkv * D), logits(Hkv * N), table(K);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = read_int(rows, r);
      const int64_t len = read_int(lengths, r);
      const int64_t n_blocks = std::min(N, (len + block_size - 1) / block_size);
      score_row(q + r * H * D, H, Hkv, D, s + b * sums.stride(0), sums.stride(1), sums.stride(2),
                c + b * counts.stride(0), counts.stride(1), n_blocks, N, o + r * N, qbar, logits, table);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("query_group_mass", &query_group_mass,
        "query_group_mass witness scores against each row's request's block centroids (see cpu_witness.py)");
}
