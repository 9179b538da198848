// The verified token exchange on decode rows, one C++ pass per row (rows in parallel).
//
// Same choice as verified_exchange.verified_exchange_decode (torch ops), which states the
// rule; the Python wrapper (verified_exchange_cpu) hands over fp32 queries already times the
// softmax scale. Per row r of request b = row_to_request[r], length n, G = H / Hkv query heads
// per KV head, key(t, g) = keys[b, t, g D : (g + 1) D]:
//
//   l[h, w]     = q[h] . key(rows[r, w], h / G)             the row's own entries
//   log_z[h]    = logsumexp_w l[h, w]
//   mass(t)     = sum_h exp(q[h] . key(t, h / G) - log_z[h])
//   upper(j)    = sum_h exp(min(sum_d max(q[h, d] min[b, j, d'], q[h, d] max[b, j, d']) - log_z[h], 80))
//                 for the blocks j with a token below n outside the row (d' = (h / G) D + d)
//
// or, ranked by `mean` (verified_exchange_mean: the drift tracker's block key sums S and
// counts c instead of the boxes; o(j) = c[b, j] less the row's entries in block j):
//
//   rank(j)     = sum_h exp(min((q[h] . S[b, j, head h / G] - sum of l[h, w] over the row's
//                 entries in block j) / o(j) - log_z[h], 80))        for the blocks with o(j) > 0
//
// The `blocks` blocks of highest upper(j) (or rank(j)) give the candidate tokens (those below n
// outside the row); the candidates, most mass first, replace the entries, least mass first (ties: lower
// slot first), while mass(candidate) > margin * mass(entry), at most `cap` of them; rows with
// n <= W keep theirs. It reads the row's W keys, the request's two box tables (or its key sums
// and counts) and the candidates' keys where they lie; nothing is gathered into a copy.

#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

namespace {

inline int64_t read_int(const torch::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i] : int64_t(t.data_ptr<int32_t>()[i]);
}

// Dot product with eight partial sums (vectorizes without -ffast-math).
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

// sum_d max(q_d lo_d, q_d hi_d): the largest q . k over the box [lo, hi].
inline float box_bound(const float* q, const float* lo, const float* hi, int64_t D) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += std::max(q[d + j] * lo[d + j], q[d + j] * hi[d + j]);
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < D; ++d) s += std::max(q[d] * lo[d], q[d] * hi[d]);
  return s;
}

// The request's block tables: the two boxes (`mean` false) or the key sums and counts.
struct Tables {
  const float* a;       // block minima, or key sums
  const float* b;       // block maxima, or nullptr
  const float* counts;  // tokens per block (mean), or nullptr
  int64_t stride;       // between blocks of a and b
  bool mean;
};

struct Scratch {
  std::vector<float> logit, log_z, entry_mass, upper, in_sum, in_count;
  std::vector<uint8_t> in_row;
  std::vector<int64_t> order_b, order_e;
  std::vector<std::pair<float, int64_t>> cand;
};

// One row: writes its W output entries and returns the swaps.
int64_t exchange_row(const float* q, int64_t H, int64_t Hkv, int64_t D, const int64_t* row, int64_t W,
                     int64_t n, const float* keys, int64_t key_stride, int64_t L, const Tables& tab, int64_t N,
                     int64_t block_size, double margin, int64_t cap, int64_t blocks, int32_t* out, Scratch& s) {
  for (int64_t w = 0; w < W; ++w) out[w] = static_cast<int32_t>(row[w]);
  if (n <= W || cap <= 0) return 0;
  const int64_t G = H / Hkv;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  s.logit.assign(H * W, neg_inf);
  for (int64_t w = 0; w < W; ++w) {
    if (row[w] < 0) continue;
    const float* k = keys + row[w] * key_stride;
    for (int64_t h = 0; h < H; ++h) s.logit[h * W + w] = dot(q + h * D, k + (h / G) * D, D);
  }
  const int64_t n_blocks = std::min(N, (n + block_size - 1) / block_size);
  if (tab.mean) {  // the row's entries per block: their count and, per head, their logits' sum
    s.in_sum.assign(n_blocks * H, 0.f);
    s.in_count.assign(n_blocks, 0.f);
    for (int64_t w = 0; w < W; ++w) {
      if (row[w] < 0 || row[w] / block_size >= n_blocks) continue;
      const int64_t j = row[w] / block_size;
      s.in_count[j] += 1.f;
      for (int64_t h = 0; h < H; ++h) s.in_sum[j * H + h] += s.logit[h * W + w];
    }
  }
  // Per head: log_z, and each entry's share exp(l - m) / z (l turned into it in place).
  s.log_z.assign(H, 0.f);
  s.entry_mass.assign(W, 0.f);
  for (int64_t h = 0; h < H; ++h) {
    float* l = s.logit.data() + h * W;
    float m = *std::max_element(l, l + W);
    if (m == neg_inf) return 0;  // no entry: nothing to compare against
    double z = 0.0;
    for (int64_t w = 0; w < W; ++w) {
      l[w] = std::exp(l[w] - m);
      z += l[w];
    }
    s.log_z[h] = m + static_cast<float>(std::log(z));
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t w = 0; w < W; ++w) s.entry_mass[w] += l[w] * inv;
  }
  for (int64_t w = 0; w < W; ++w) {
    if (row[w] < 0) s.entry_mass[w] = 1e30f;  // padding never goes
  }
  s.in_row.assign(n, 0);
  for (int64_t w = 0; w < W; ++w) {
    if (row[w] >= 0 && row[w] < n) s.in_row[row[w]] = 1;
  }
  s.upper.assign(n_blocks, neg_inf);
  s.order_b.clear();
  for (int64_t j = 0; j < n_blocks; ++j) {
    float total = 0.f;
    if (tab.mean) {
      const float n_out = tab.counts[j] - s.in_count[j];
      if (!(n_out > 0.f)) continue;
      const float* sum = tab.a + j * tab.stride;
      for (int64_t h = 0; h < H; ++h) {
        const float mean = (dot(q + h * D, sum + (h / G) * D, D) - s.in_sum[j * H + h]) / n_out;
        total += std::exp(std::min(mean - s.log_z[h], 80.0f));
      }
    } else {
      const int64_t first = j * block_size, last = std::min(n, first + block_size);
      bool outside = false;
      for (int64_t t = first; t < last && !outside; ++t) outside = !s.in_row[t];
      if (!outside) continue;
      const float* lo = tab.a + j * tab.stride;
      const float* hi = tab.b + j * tab.stride;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = (h / G) * D;
        total += std::exp(std::min(box_bound(q + h * D, lo + g, hi + g, D) - s.log_z[h], 80.0f));
      }
    }
    s.upper[j] = total;
    s.order_b.push_back(j);
  }
  const int64_t M = std::min<int64_t>(blocks, static_cast<int64_t>(s.order_b.size()));
  std::partial_sort(s.order_b.begin(), s.order_b.begin() + M, s.order_b.end(),
                    [&](int64_t a, int64_t b) { return s.upper[a] > s.upper[b]; });
  s.cand.clear();
  for (int64_t i = 0; i < M; ++i) {
    const int64_t first = s.order_b[i] * block_size, last = std::min(n, first + block_size);
    for (int64_t t = first; t < last; ++t) {
      if (s.in_row[t] || t >= L) continue;
      const float* k = keys + t * key_stride;
      float mass = 0.f;
      for (int64_t h = 0; h < H; ++h) mass += std::exp(dot(q + h * D, k + (h / G) * D, D) - s.log_z[h]);
      s.cand.emplace_back(mass, t);
    }
  }
  const int64_t pairs = std::min<int64_t>(cap, static_cast<int64_t>(s.cand.size()));
  std::partial_sort(s.cand.begin(), s.cand.begin() + pairs, s.cand.end(),
                    [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
                      return a.first > b.first;
                    });
  s.order_e.resize(W);
  std::iota(s.order_e.begin(), s.order_e.end(), 0);
  std::partial_sort(s.order_e.begin(), s.order_e.begin() + pairs, s.order_e.end(), [&](int64_t a, int64_t b) {
    return std::make_tuple(s.entry_mass[a], a) < std::make_tuple(s.entry_mass[b], b);
  });
  int64_t taken = 0;
  for (; taken < pairs; ++taken) {
    const int64_t slot = s.order_e[taken];
    if (!(s.cand[taken].first > margin * s.entry_mass[slot])) break;
    out[slot] = static_cast<int32_t>(s.cand[taken].second);
  }
  return taken;
}

// Checks every argument and index, then runs the rows in parallel. `a` / `b`: the boxes'
// minima and maxima, or (mean) the key sums and the counts [B, N].
std::tuple<torch::Tensor, torch::Tensor> run(const char* name, const torch::Tensor& rows, const torch::Tensor& lengths,
                                             const torch::Tensor& queries, const torch::Tensor& keys,
                                             const torch::Tensor& a, const torch::Tensor& b,
                                             const torch::Tensor& row_to_request, int64_t block_size, double margin,
                                             int64_t cap, int64_t blocks, bool mean) {
  for (const auto* t : {&rows, &lengths, &queries, &keys, &a, &b, &row_to_request}) {
    TORCH_CHECK(t->device().is_cpu(), name, ": every tensor must be on the CPU");
  }
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
              "rows: expected contiguous int64 [R, W], got ", rows.scalar_type(), " of shape ", rows.sizes());
  const int64_t R = rows.size(0), W = rows.size(1);
  TORCH_CHECK(queries.dim() == 3 && queries.size(0) == R && queries.is_contiguous() &&
                  queries.scalar_type() == at::kFloat,
              "queries: expected contiguous float32 [", R, ", H, D], got ", queries.scalar_type(), " of shape ",
              queries.sizes());
  const int64_t H = queries.size(1), D = queries.size(2);
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && keys.stride(2) == 1,
              "keys: expected float32 [B, L, Hkv * D] with unit stride in its last dim, got ", keys.scalar_type(),
              " of shape ", keys.sizes());
  const int64_t B = keys.size(0), L = keys.size(1), K = keys.size(2);
  TORCH_CHECK(D > 0 && K % D == 0 && K / D > 0 && H % (K / D) == 0, "keys: expected [B, L, Hkv * ", D,
              "] with Hkv dividing ", H, " query heads, got shape ", keys.sizes());
  const char* a_name = mean ? "block_sums" : "block_min";
  TORCH_CHECK(a.dim() == 3 && a.size(0) == B && a.size(2) == K && a.scalar_type() == at::kFloat && a.stride(2) == 1,
              a_name, ": expected float32 [", B, ", N, ", K, "] with unit last stride, got ", a.scalar_type(),
              " of shape ", a.sizes());
  const int64_t N = a.size(1);
  if (mean) {
    TORCH_CHECK(b.dim() == 2 && b.size(0) == B && b.size(1) == N && b.is_contiguous() &&
                    b.scalar_type() == at::kFloat,
                "block_counts: expected contiguous float32 [", B, ", ", N, "], got ", b.scalar_type(), " of shape ",
                b.sizes());
  } else {
    TORCH_CHECK(b.sizes() == a.sizes() && b.strides() == a.strides() && b.scalar_type() == at::kFloat,
                "block_max: expected float32 [", B, ", N, ", K, "] (unit last stride, as block_min), got ",
                b.scalar_type(), " of shape ", b.sizes());
  }
  for (const auto* t : {&lengths, &row_to_request}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->is_contiguous() &&
                    (t->scalar_type() == at::kLong || t->scalar_type() == at::kInt),
                t == &lengths ? "lengths" : "row_to_request", ": expected int32 or int64 [", R, "], got ",
                t->scalar_type(), " of shape ", t->sizes());
  }
  TORCH_CHECK(block_size > 0, "block_size: expected > 0, got ", block_size);
  TORCH_CHECK(blocks > 0, "blocks: expected > 0, got ", blocks);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {  // every index checked before any work
    const int64_t req = read_int(row_to_request, i), n = read_int(lengths, i);
    TORCH_CHECK(req >= 0 && req < B, "row_to_request: expected values in [0, ", B, "), got ", req, " at row ", i);
    TORCH_CHECK(n > 0 && n <= L, "lengths: expected values in [1, ", L, "], got ", n, " at row ", i);
    for (int64_t w = 0; w < W; ++w) {
      TORCH_CHECK(r[i * W + w] >= -1 && r[i * W + w] < n, "rows: expected -1 or a position below the row's length ",
                  n, ", got ", r[i * W + w], " at row ", i);
    }
  }
  auto out = torch::empty({R, W}, rows.options().dtype(at::kInt));
  auto swaps = torch::zeros({R}, rows.options());
  const int64_t Hkv = K / D;
  const float* q = queries.data_ptr<float>();
  const float* k = keys.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  int32_t* o = out.data_ptr<int32_t>();
  int64_t* sw = swaps.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t req = read_int(row_to_request, i);
      const Tables tab = mean ? Tables{pa + req * a.stride(0), nullptr, pb + req * N, a.stride(1), true}
                              : Tables{pa + req * a.stride(0), pb + req * b.stride(0), nullptr, a.stride(1), false};
      sw[i] = exchange_row(q + i * H * D, H, Hkv, D, r + i * W, W, read_int(lengths, i), k + req * keys.stride(0),
                           keys.stride(1), L, tab, N, block_size, margin, cap, blocks, o + i * W, s);
    }
  });
  return {out, swaps};
}

std::tuple<torch::Tensor, torch::Tensor> verified_exchange(const torch::Tensor& rows, const torch::Tensor& lengths,
                                                           const torch::Tensor& queries, const torch::Tensor& keys,
                                                           const torch::Tensor& block_min,
                                                           const torch::Tensor& block_max,
                                                           const torch::Tensor& row_to_request, int64_t block_size,
                                                           double margin, int64_t cap, int64_t blocks) {
  return run("verified_exchange", rows, lengths, queries, keys, block_min, block_max, row_to_request, block_size,
             margin, cap, blocks, false);
}

std::tuple<torch::Tensor, torch::Tensor> verified_exchange_mean(
    const torch::Tensor& rows, const torch::Tensor& lengths, const torch::Tensor& queries, const torch::Tensor& keys,
    const torch::Tensor& block_sums, const torch::Tensor& block_counts, const torch::Tensor& row_to_request,
    int64_t block_size, double margin, int64_t cap, int64_t blocks) {
  return run("verified_exchange_mean", rows, lengths, queries, keys, block_sums, block_counts, row_to_request,
             block_size, margin, cap, blocks, true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verified_exchange", &verified_exchange,
        "the verified token exchange on decode rows (see benchmark/candidates/verified_exchange.py)");
  m.def("verified_exchange_mean", &verified_exchange_mean,
        "the verified token exchange, candidate blocks ranked by their outsiders' mean logit");
}
