// The topology KV candidate policy as one fused CPU pass per row, rows in parallel.
//
// Same semantics as topology_kv_policy_core (its docstring is the specification); one
// entry, `run_layer` below, checks the metadata, converts float inputs to fp32 exactly
// as the core does and runs the rows. Per row, sequentially:
//
//  1. load the row (int64), check the coordinate contract (offset, length, dtype overflow,
//     interval, padding order, duplicates by a per-thread bitmap over the row's interval or
//     a sort for huge intervals, drift coverage); a broken row is copied unchanged;
//  2. schedule: sink / local blocks by arithmetic, witness blocks by a partial sort of the
//     eligible blocks' unique int64 keys (fp32 drift bits made monotone, NaN as -inf,
//     -0.0 as +0.0, the block reversed in the low 32 bits: ties to the lower block), and
//     expand them to the structural tokens in priority order (tok[S]: sinks ascending,
//     local and witness blocks newest token first, so a block the budget cuts keeps its
//     newest tokens);
//  3. map every learned entry to its priority slot by arithmetic (witness blocks through a
//     per-thread block -> pick table), marking the slots the row already holds;
//  4. merge modes: one walk over the slots gives the target prefix (<= W tokens, <= cap
//     missing) and the injected tokens; eviction takes the row's last non-structural
//     entries, or with scores the lowest keys (fp32 bits, column reversed: the later
//     column loses a tie) by nth_element + sort of the evicted prefix; the rest fills the
//     padding after the valid entries. TOPOLOGY_ONLY: the first W structural tokens.
//  5. counters per chunk of rows, added atomically to the caller's int64 buffer.

#include <torch/python.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBitmapMaxLength = int64_t(1) << 24;  // larger intervals: duplicates by sort
constexpr int kCounters = 8;

struct Params {
  int64_t R, W;
  const void* x; int64_t sx0, sx1;
  void* out; int64_t so0, so1;
  const void* len; int64_t slen; bool len64;
  const void* off; int64_t soff; bool off64; bool has_off;
  const float* drift; int64_t sd0, sd1, N; bool has_drift;
  const void* r2r; int64_t sr2r; bool r2r64;  // drift row of row r: r2r[r] (nullptr: r)
  const float* scores; int64_t ss0, ss1; bool has_scores;
  const void* scaf; int64_t sscaf; bool scaf64; bool compress;
  int64_t* counters; int64_t scnt;
  bool* mismatch; int64_t smis;
  bool only;
  int64_t sink_blocks, local_blocks, n_wit, bs, cap;
  bool token_sinks; int64_t sink_tokens;
  bool scale;
};

inline int64_t read_int(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

inline int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// Order-preserving int of an fp32 score (score_sort_keys): NaN as -inf, -0.0 as +0.0.
inline int64_t score_bits(float s) {
  if (std::isnan(s)) s = -std::numeric_limits<float>::infinity();
  if (s == 0.0f) s = 0.0f;
  int32_t bits;
  std::memcpy(&bits, &s, sizeof(bits));
  return int64_t(bits < 0 ? (bits ^ 0x7FFFFFFF) : bits);
}

constexpr int64_t kShift = int64_t(1) << 32;

// Division of non-negative values by the block size: a shift when it is a power of two
// (the engine's 64), else a division (a 64-bit idiv costs ~40 cycles: kept out of loops).
struct BlockDiv {
  int64_t bs;
  int shift;
  bool pow2;
  explicit BlockDiv(int64_t b) : bs(b), shift(0), pow2((b & (b - 1)) == 0) {
    while ((int64_t(1) << shift) < b) ++shift;
  }
  int64_t div(int64_t v) const { return pow2 ? (v >> shift) : v / bs; }
  int64_t mod(int64_t v) const { return pow2 ? (v & (bs - 1)) : v % bs; }
};

// key[0, n) sorted ascending: a least-significant-digit radix sort on 8-bit digits (stable
// passes, so the result is the full 64-bit order, as std::sort gives it), skipping every
// digit all keys share (the exponent bits of similar scores, the column's high zeros).
// Below 64 keys, std::sort.
void radix_sort(uint64_t* key, int64_t n, std::vector<uint64_t>& tmp) {
  if (n < 64) {
    std::sort(key, key + n);
    return;
  }
  uint64_t all_or = 0, all_and = ~uint64_t(0);
  for (int64_t i = 0; i < n; ++i) {
    all_or |= key[i];
    all_and &= key[i];
  }
  const uint64_t varying = all_or ^ all_and;  // bits that differ between some keys
  if (tmp.size() < size_t(n)) tmp.resize(size_t(n));
  uint64_t* src = key;
  uint64_t* dst = tmp.data();
  for (int shift = 0; shift < 64; shift += 8) {
    if (((varying >> shift) & 255) == 0) continue;
    int64_t count[256] = {0};
    for (int64_t i = 0; i < n; ++i) ++count[(src[i] >> shift) & 255];
    int64_t sum = 0;
    for (int d = 0; d < 256; ++d) {
      const int64_t c = count[d];
      count[d] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; ++i) dst[count[(src[i] >> shift) & 255]++] = src[i];
    std::swap(src, dst);
  }
  if (src != key) std::memcpy(key, src, size_t(n) * sizeof(uint64_t));
}

// The k smallest of key[0, n) (unique), sorted ascending into key[0, k). A radix select on
// 8-bit digits from the top finds the digits that separate them (each pass scans only the
// bucket holding the k-th smallest), then one compaction and a radix sort of the k.
void lowest_sorted(uint64_t* key, int64_t n, int64_t k, std::vector<uint64_t>& tmp) {
  if (k <= 0) return;
  if (k >= n) {
    radix_sort(key, n, tmp);
    return;
  }
  tmp.resize(size_t(n));
  const uint64_t* src = key;
  int64_t m = n, below = 0;
  uint64_t prefix = 0;
  int shift = 56;
  for (;; shift -= 8) {
    int64_t hist[256] = {0};
    for (int64_t i = 0; i < m; ++i) ++hist[(src[i] >> shift) & 255];
    int d = 0;
    while (below + hist[d] < k) below += hist[d++];
    prefix |= uint64_t(d) << shift;
    if (below + hist[d] == k || shift == 0) break;  // keys are unique: shift 0 always ends here
    int64_t mm = 0;  // keep bucket d (in place when src is tmp: writes trail reads)
    for (int64_t i = 0; i < m; ++i) {  // branchless: which keys stay is data-dependent
      const uint64_t v = src[i];
      tmp[mm] = v;
      mm += int((v >> shift) & 255) == d;
    }
    src = tmp.data();
    m = mm;
  }
  const uint64_t lim = prefix >> shift;  // exactly k keys have top bits <= lim
  int64_t w = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t v = key[i];
    key[w] = v;
    w += (v >> shift) <= lim;
  }
  radix_sort(key, k, tmp);
}

// v.size() >= n afterwards; new elements are `fill`, existing ones keep their values.
template <typename V>
void grow(std::vector<V>& v, int64_t n, V fill = V()) {
  if (v.size() < size_t(n)) v.resize(size_t(n), fill);
}

struct Scratch {
  std::vector<uint64_t> ukeys, utmp;
  std::vector<int64_t> xr, res, tok, inj, keys, wit, pos;
  std::vector<int32_t> ps, wit_of;
  std::vector<uint8_t> flag;  // per priority slot: 1 present, 2 taken; [S] a dummy
  std::vector<uint64_t> bitmap;
};

template <typename T>
void run_rows(const Params& P, int64_t begin, int64_t end) {
  const int64_t W = P.W, bs = P.bs;
  const bool token_sinks = P.token_sinks;
  const int64_t sink_blk = token_sinks ? P.sink_tokens / bs : P.sink_blocks;
  const bool partial = token_sinks && (P.sink_tokens % bs != 0);
  const int64_t S_sink = token_sinks ? P.sink_tokens : P.sink_blocks * bs;
  const int64_t l_tok = P.local_blocks * bs;
  const int64_t n_wit = P.n_wit;
  const int64_t S = S_sink + l_tok + n_wit * bs;
  const int64_t comp_start_blk = token_sinks ? (P.sink_tokens + bs - 1) / bs : 0;
  const int64_t imax = std::numeric_limits<T>::max();
  const BlockDiv bd(bs);

  // One scratch per thread, kept between calls (a decode step calls every layer with the
  // same shapes): buffers only grow. Between rows (and calls) `flag` is all 0, `wit_of`
  // all -1 and `bitmap` all 0; every row restores what it sets. The others are written
  // before they are read.
  thread_local Scratch s;
  grow(s.xr, W);
  grow(s.res, W);
  grow(s.pos, W);
  grow(s.ps, W);
  grow(s.tok, S + 1);
  s.tok[S] = -1;  // slot S: "not structural" (never matches a position)
  grow(s.inj, S);
  grow(s.flag, S + 1, uint8_t(0));  // flag[S] stays 0 (rewritten below, re-zeroed)
  grow(s.wit, n_wit);
  if (P.has_drift) grow(s.wit_of, P.N, int32_t(-1));
  int64_t acc[kCounters] = {0, 0, 0, 0, 0, 0, 0, 0};

  for (int64_t r = begin; r < end; ++r) {
    const T* xrow = static_cast<const T*>(P.x) + r * P.sx0;
    T* orow = static_cast<T*>(P.out) + r * P.so0;
    int64_t* xr = s.xr.data();

    // ---- 1. load the row and check the contract ----
    int64_t n_valid = 0;
    bool seen_pad = false, late = false;
    for (int64_t c = 0; c < W; ++c) {
      const int64_t v = int64_t(xrow[c * P.sx1]);
      xr[c] = v;
      if (v >= 0) {
        ++n_valid;
        late |= seen_pad;
      } else {
        seen_pad = true;
      }
    }
    const int64_t length = read_int(P.len, P.len64, r * P.slen);
    const int64_t off = P.has_off ? read_int(P.off, P.off64, r * P.soff) : 0;
    bool broken = late || off < 0 || length <= 0 || length - 1 > imax - off;
    int64_t nb = 0;
    if (!broken) {
      for (int64_t c = 0; c < n_valid; ++c) {
        const int64_t v = xr[c];
        broken |= (v < off) | (v - off >= length);
      }
      nb = (length - 1) / bs + 1;
      if (P.has_drift && nb > P.N) broken = true;
    }
    if (!broken && n_valid > 1) {  // duplicates
      if (length <= kBitmapMaxLength) {
        const size_t words = size_t((length + 63) >> 6);
        if (s.bitmap.size() < words) s.bitmap.resize(words, 0);
        uint64_t* bm = s.bitmap.data();
        int64_t c = 0;
        for (; c < n_valid; ++c) {
          const int64_t t = xr[c] - off;
          const uint64_t bit = uint64_t(1) << (t & 63);
          if (bm[t >> 6] & bit) { broken = true; break; }
          bm[t >> 6] |= bit;
        }
        for (int64_t k = 0; k < c; ++k) {  // clear what was set
          const int64_t t = xr[k] - off;
          bm[t >> 6] &= ~(uint64_t(1) << (t & 63));
        }
      } else {
        std::vector<int64_t>& v = s.pos;
        std::copy(xr, xr + n_valid, v.begin());
        std::sort(v.begin(), v.begin() + n_valid);
        for (int64_t c = 1; c < n_valid; ++c) broken |= v[c] == v[c - 1];
      }
    }
    if (P.mismatch) P.mismatch[r * P.smis] = broken;
    if (broken) {  // returned exactly as it came
      for (int64_t c = 0; c < W; ++c) orow[c * P.so1] = xrow[c * P.sx1];
      acc[5] += 1;
      continue;
    }

    // ---- 2. the schedule and the structural tokens in priority order ----
    const int64_t L = length;
    const int64_t sink_end = std::min(nb, sink_blk);
    const int64_t local_start = std::max(std::max<int64_t>(nb - P.local_blocks, 0), sink_end);
    const int64_t sink_tok_end = token_sinks ? std::min(S_sink, L) : std::min(sink_end * bs, L);
    const int64_t local_tok_start = local_start * bs;
    int64_t comp_blk_end = 0;  // compress: blocks [comp_start_blk, comp_blk_end) keep one token
    if (P.compress) {
      const int64_t span = std::min(read_int(P.scaf, P.scaf64, r * P.sscaf), L);
      comp_blk_end = floor_div(span, bs);
    }
    auto compressed = [&](int64_t blk) { return blk >= comp_start_blk && blk < comp_blk_end; };

    int64_t* wit = s.wit.data();
    const int64_t eligible = std::max<int64_t>(local_start - sink_end, 0);
    if (P.has_drift) {
      const int64_t k = std::min(n_wit, eligible);
      if (k > 0) {
        grow(s.keys, eligible);
        int64_t* key = s.keys.data();
        const float* d = P.drift + (P.r2r ? read_int(P.r2r, P.r2r64, r * P.sr2r) : r) * P.sd0;
        for (int64_t b = sink_end; b < local_start; ++b)
          key[b - sink_end] = score_bits(d[b * P.sd1]) * kShift + (P.N - 1 - b);
        if (k < eligible)
          std::partial_sort(key, key + k, key + eligible, std::greater<int64_t>());
        else
          std::sort(key, key + eligible, std::greater<int64_t>());
        for (int64_t j = 0; j < k; ++j) wit[j] = P.N - 1 - (key[j] & 0xFFFFFFFF);
      }
      for (int64_t j = std::max<int64_t>(k, 0); j < n_wit; ++j) wit[j] = -1;
      for (int64_t j = 0; j < k; ++j) s.wit_of[wit[j]] = int32_t(j);
    } else {  // fallback scores = block index: the blocks right below the locals
      for (int64_t j = 0; j < n_wit; ++j) {
        const int64_t b = local_start - 1 - j;
        wit[j] = b >= sink_end ? b : -1;
      }
    }

    int64_t* tok = s.tok.data();
    int64_t n_comp = 0;
    if (token_sinks) {  // sinks ascending
      for (int64_t p = 0; p < S_sink; ++p) tok[p] = p < L ? p : -1;
    } else {
      for (int64_t blk = 0; blk < P.sink_blocks; ++blk) {
        const bool comp = P.compress && blk < sink_end && compressed(blk);
        n_comp += comp;
        for (int64_t i = 0; i < bs; ++i) {
          const int64_t t = blk * bs + i;
          tok[t] = (blk >= sink_end || t >= L || (comp && i != 0)) ? -1 : t;
        }
      }
    }
    for (int64_t lb = 0; lb < P.local_blocks; ++lb) {  // locals: priority newest first
      const int64_t blk = local_start + lb;
      const bool comp = P.compress && blk < nb && compressed(blk);
      n_comp += comp;
      int64_t* dst = tok + S_sink + l_tok - 1 - lb * bs;  // layout q = lb * bs + i at dst[-i]
      for (int64_t i = 0; i < bs; ++i) {
        const int64_t t = blk * bs + i;
        dst[-i] = (blk >= nb || t >= L || (partial && t < P.sink_tokens) || (comp && i != 0)) ? -1 : t;
      }
    }
    for (int64_t j = 0; j < n_wit; ++j) {  // witnesses in score order, tokens newest first
      const int64_t blk = wit[j];
      const bool comp = P.compress && blk >= 0 && compressed(blk);
      n_comp += comp;
      int64_t* dst = tok + S_sink + l_tok + j * bs + bs - 1;  // token i of the block at dst[-i]
      for (int64_t i = 0; i < bs; ++i) {
        int64_t t = blk * bs + i;
        if (blk < 0 || t >= L || (partial && t < P.sink_tokens) || (comp && i != 0)) t = -1;
        dst[-i] = t;
      }
    }

    // ---- 3. learned entries -> priority slot (S: not structural) ----
    int32_t* ps = s.ps.data();
    uint8_t* flag = s.flag.data();
    const int64_t local_lo = std::max(local_tok_start, sink_tok_end);
    // Witness blocks lie in [sink_end, local_start); without drift in the last n_wit of them.
    const int64_t wit_lo = (P.has_drift ? sink_end : std::max(sink_end, local_start - n_wit)) * bs;
    const int64_t wit_hi = n_wit > 0 ? local_tok_start : 0;
    const int64_t comp_lo = comp_start_blk * bs, comp_hi = comp_blk_end * bs;
    // Selects rather than branches: which segment an entry hits is data-dependent.
    // (Without locals, local_tok_start = nb * bs >= L: no entry reaches the local segment.)
    const int32_t* wit_of = P.has_drift ? s.wit_of.data() : nullptr;
    const int64_t wit_base = S_sink + l_tok;
    for (int64_t c = 0; c < n_valid; ++c) {
      const int64_t rel = xr[c] - off;
      const int64_t b = bd.div(rel);
      const int64_t in_blk = rel - b * bs;
      int64_t j = -1;
      if (rel >= wit_lo && rel < wit_hi) j = wit_of ? int64_t(wit_of[b]) : local_start - 1 - b;
      int64_t slot = j >= 0 ? wit_base + j * bs + bs - 1 - in_blk : S;
      slot = rel >= local_lo ? S_sink + l_tok - 1 - (rel - local_tok_start) : slot;
      slot = rel < sink_tok_end ? rel : slot;
      if (P.compress) slot = (rel >= comp_lo && rel < comp_hi && in_blk != 0) ? S : slot;
      slot = tok[slot] == rel ? slot : S;  // an invalid slot holds nothing
      ps[c] = int32_t(slot);
      flag[slot] = 1;
    }
    flag[S] = 0;
    if (P.has_drift)
      for (int64_t j = 0; j < n_wit && wit[j] >= 0; ++j) s.wit_of[wit[j]] = -1;

    int64_t* res = s.res.data();
    int64_t n_sel, n_inj, n_kept, n_evict;
    if (P.only) {
      // ---- TOPOLOGY_ONLY: the first W structural tokens in priority order ----
      int64_t k = 0;
      for (int64_t p = 0; p < S && k < W; ++p) {
        if (tok[p] < 0) continue;
        flag[p] |= 2;
        res[k++] = tok[p] + off;
      }
      n_sel = k;
      for (; k < W; ++k) res[k] = -1;
      n_kept = 0;
      for (int64_t c = 0; c < n_valid; ++c) n_kept += flag[ps[c]] >> 1;
      n_inj = n_sel - n_kept;
      n_evict = n_valid - n_kept;
    } else {
      // ---- 4. merge: target prefix, injected tokens, eviction, fill ----
      int64_t cap = P.cap;
      if (P.scale) cap = floor_div(P.cap * W, std::max(L, W));
      int64_t* inj = s.inj.data();
      int64_t rank_valid = 0, new_rank = 0;
      n_inj = 0;
      for (int64_t p = 0; p < S; ++p) {
        if (tok[p] < 0) continue;
        ++rank_valid;
        const bool is_new = !(flag[p] & 1);
        new_rank += is_new;
        if (rank_valid > W || new_rank > cap) break;  // both only grow: the rest is not taken
        flag[p] |= 2;
        if (is_new) inj[n_inj++] = tok[p] + off;
      }
      n_evict = std::max<int64_t>(n_valid + n_inj - W, 0);
      for (int64_t c = 0; c < W; ++c) res[c] = c < n_valid ? xr[c] : -1;
      auto is_struct = [&](int64_t c) { return (flag[ps[c]] & 2) != 0; };
      if (n_evict > 0) {
        if (!P.has_scores) {  // the row's last n_evict non-structural entries, in row order
          int64_t* pos = s.pos.data();
          int64_t cnt = 0;
          for (int64_t c = n_valid - 1; c >= 0 && cnt < n_evict; --c)
            if (!is_struct(c)) pos[cnt++] = c;
          for (int64_t e = 0; e < cnt; ++e) res[pos[cnt - 1 - e]] = inj[e];
        } else {  // lowest score first, ties: the later column first
          // Unsigned keys (the int64 key with its sign bit flipped: same order).
          grow(s.ukeys, W);
          uint64_t* key = s.ukeys.data();
          const float* sc = P.scores + r * P.ss0;
          const uint64_t flip = uint64_t(1) << 63;
          int64_t n = 0;
          for (int64_t c = 0; c < n_valid; ++c) {
            key[n] = uint64_t(score_bits(sc[c * P.ss1]) * kShift + (W - 1 - c)) ^ flip;
            n += !is_struct(c);
          }
          const int64_t k = std::min(n_evict, n);
          lowest_sorted(key, n, k, s.utmp);
          for (int64_t e = 0; e < k; ++e) res[W - 1 - int64_t(key[e] & 0xFFFFFFFF)] = inj[e];
        }
      }
      for (int64_t e = n_evict; e < n_inj; ++e) res[n_valid + e - n_evict] = inj[e];
      n_kept = n_valid - n_evict;
      n_sel = n_kept + n_inj;
    }
    std::memset(flag, 0, size_t(S));
    for (int64_t c = 0; c < W; ++c) orow[c * P.so1] = T(res[c]);

    acc[0] += n_sel;
    acc[1] += n_inj;
    acc[2] += n_kept;
    acc[3] += n_evict;
    acc[4] += L - n_sel;
    acc[6] += n_comp;
    acc[7] += n_comp * (bs - 1);
  }
  for (int i = 0; i < kCounters; ++i)
    if (acc[i]) __atomic_fetch_add(P.counters + i * P.scnt, acc[i], __ATOMIC_RELAXED);
}

const void* opt_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// All arguments validated by the caller (shapes, dtypes, devices; drift and scores fp32).
// `n_wit` is the witness picks (TOPOLOGY_ONLY: ceil(W / bs) + 1); `sink_tokens` < 0
// selects whole sink blocks; `r2r` maps rows to drift rows (nullopt: row r reads row r).
void run_params(const at::Tensor& x, const at::Tensor& out, const at::Tensor& lengths,
                const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& drift,
                const c10::optional<at::Tensor>& r2r, const c10::optional<at::Tensor>& scores,
                const c10::optional<at::Tensor>& scaffold, const at::Tensor& counters,
                const c10::optional<at::Tensor>& mismatch, bool only, bool compress, int64_t sink_blocks,
                int64_t local_blocks, int64_t n_wit, int64_t block_size, int64_t structural_cap,
                int64_t sink_tokens, bool scale, int64_t grain) {
  Params P{};
  P.R = x.size(0);
  P.W = x.size(1);
  if (P.R == 0) return;
  P.x = x.data_ptr(); P.sx0 = x.stride(0); P.sx1 = x.stride(1);
  P.out = out.data_ptr(); P.so0 = out.stride(0); P.so1 = out.stride(1);
  P.len = lengths.data_ptr(); P.slen = lengths.stride(0); P.len64 = lengths.scalar_type() == at::kLong;
  P.has_off = offsets.has_value();
  P.off = opt_ptr(offsets);
  P.soff = P.has_off ? offsets->stride(0) : 0;
  P.off64 = P.has_off && offsets->scalar_type() == at::kLong;
  P.has_drift = drift.has_value();
  P.drift = P.has_drift ? drift->data_ptr<float>() : nullptr;
  P.sd0 = P.has_drift ? drift->stride(0) : 0;
  P.sd1 = P.has_drift ? drift->stride(1) : 0;
  P.N = P.has_drift ? drift->size(1) : 0;
  P.r2r = P.has_drift && r2r.has_value() ? r2r->data_ptr() : nullptr;
  P.sr2r = P.r2r ? r2r->stride(0) : 0;
  P.r2r64 = P.r2r && r2r->scalar_type() == at::kLong;
  P.has_scores = scores.has_value();
  P.scores = P.has_scores ? scores->data_ptr<float>() : nullptr;
  P.ss0 = P.has_scores ? scores->stride(0) : 0;
  P.ss1 = P.has_scores ? scores->stride(1) : 0;
  P.compress = compress;
  P.scaf = compress ? scaffold->data_ptr() : nullptr;
  P.sscaf = compress ? scaffold->stride(0) : 0;
  P.scaf64 = compress && scaffold->scalar_type() == at::kLong;
  P.counters = counters.data_ptr<int64_t>();
  P.scnt = counters.stride(0);
  P.mismatch = mismatch.has_value() ? mismatch->data_ptr<bool>() : nullptr;
  P.smis = mismatch.has_value() ? mismatch->stride(0) : 0;
  P.only = only;
  P.sink_blocks = sink_blocks;
  P.local_blocks = local_blocks;
  P.n_wit = n_wit;
  P.bs = block_size;
  P.cap = structural_cap;
  P.token_sinks = sink_tokens >= 0;
  P.sink_tokens = sink_tokens >= 0 ? sink_tokens : 0;
  P.scale = scale;
  const bool i64 = x.scalar_type() == at::kLong;
  at::parallel_for(0, P.R, std::max<int64_t>(grain, 1), [&](int64_t b, int64_t e) {
    if (i64) run_rows<int64_t>(P, b, e);
    else run_rows<int32_t>(P, b, e);
  });
}

bool is_index(const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; }

void check_vector(const char* name, const at::Tensor& t, int64_t R) {
  TORCH_CHECK_TYPE(is_index(t), name, ": expected an int32/int64 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == R && t.device().is_cpu(), name, ": expected shape (", R,
                    ",) on cpu, got ", t.sizes(), " on ", t.device());
}

// The one entry from Python (cpu_fused.py: a layer's call, run_layout's, the kernel
// wrapper's): the metadata checks here, in C++; drift [B, N] read through row_to_request
// [R] (every entry checked in [0, B) before any row runs), or [R, N] without it; learned
// scores read as fp32; out and counters the caller's (counters accumulate) or allocated
// here, straight from the CPU allocator (a dispatched at::empty / at::zeros costs tens of
// microseconds when its code is cold, as between two layers of a decode step);
// mismatch_rows [R] bool, when given, set to the broken-row flags. Returns (out, counters).
std::vector<at::Tensor> run_layer(const at::Tensor& x, const at::Tensor& lengths,
                                  const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& drift_in,
                                  const c10::optional<at::Tensor>& row_to_request,
                                  const c10::optional<at::Tensor>& scaffold,
                                  const c10::optional<at::Tensor>& scores_in, const c10::optional<at::Tensor>& out_in,
                                  const c10::optional<at::Tensor>& counters_in,
                                  const c10::optional<at::Tensor>& mismatch, bool only, bool compress,
                                  int64_t sink_blocks, int64_t local_blocks, int64_t n_wit, int64_t block_size,
                                  int64_t structural_cap, int64_t sink_tokens, bool scale, int64_t grain) {
  TORCH_CHECK_TYPE(is_index(x) && x.dim() == 2, "topk_indices: expected an int32/int64 tensor [R, W], got ",
                   x.scalar_type(), " ", x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu(), "topk_indices: expected a CPU tensor, got ", x.device());
  const int64_t R = x.size(0);
  check_vector("lengths", lengths, R);
  if (offsets.has_value()) check_vector("offsets", *offsets, R);
  const bool comp = compress && scaffold.has_value();
  if (comp) check_vector("scaffold_lengths", *scaffold, R);
  c10::optional<at::Tensor> drift;
  c10::optional<at::Tensor> r2r;
  if (drift_in.has_value()) {
    const at::Tensor& d = *drift_in;
    TORCH_CHECK_VALUE(d.is_floating_point() && d.dim() == 2 && d.device().is_cpu(),
                      "drift: expected a float tensor [B, N] on cpu, got ", d.scalar_type(), " ", d.sizes(), " on ",
                      d.device());
    drift = d.scalar_type() == at::kFloat ? d : d.to(at::kFloat);
    if (row_to_request.has_value()) {
      const at::Tensor& m = *row_to_request;
      check_vector("row_to_request", m, R);
      const int64_t B = d.size(0);
      const bool m64 = m.scalar_type() == at::kLong;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t v = read_int(m.data_ptr(), m64, r * m.stride(0));
        TORCH_CHECK_VALUE(v >= 0 && v < B, "row_to_request: row ", r, " holds ", v, ", outside [0, ", B,
                          ") (the rows of block_drift_scores)");
      }
      r2r = m;
    } else {
      TORCH_CHECK_VALUE(d.size(0) == R, "drift: expected a float tensor [", R, ", N] on cpu, got ", d.sizes());
    }
  }
  const int64_t W = x.size(1);
  c10::optional<at::Tensor> scores;
  if (scores_in.has_value() && !only) {
    const at::Tensor& t = *scores_in;
    TORCH_CHECK_VALUE(t.is_floating_point() && t.dim() == 2 && t.size(0) == R && t.size(1) == W && t.device().is_cpu(),
                      "learned_scores: expected a float tensor [", R, ", ", W, "] on cpu, got ", t.scalar_type(), " ",
                      t.sizes(), " on ", t.device());
    scores = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  }
  at::Tensor out;
  if (out_in.has_value()) {
    out = *out_in;
    TORCH_CHECK_VALUE(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == R && out.size(1) == W &&
                      out.device().is_cpu(), "out: expected ", x.scalar_type(), " [", R, ", ", W, "] on cpu, got ",
                      out.scalar_type(), " ", out.sizes(), " on ", out.device());
  } else {
    out = at::Tensor(at::detail::empty_cpu({R, W}, x.scalar_type(), false, c10::nullopt));
  }
  at::Tensor counters;
  if (counters_in.has_value()) {
    counters = *counters_in;
    TORCH_CHECK_VALUE(counters.scalar_type() == at::kLong && counters.dim() == 1 && counters.size(0) == kCounters &&
                      counters.device().is_cpu(), "counters: expected int64 [", kCounters, "] on cpu, got ",
                      counters.scalar_type(), " ", counters.sizes(), " on ", counters.device());
  } else {
    counters = at::Tensor(at::detail::empty_cpu({kCounters}, at::kLong, false, c10::nullopt));
    std::memset(counters.data_ptr<int64_t>(), 0, sizeof(int64_t) * kCounters);
  }
  if (mismatch.has_value()) {
    const at::Tensor& m = *mismatch;
    TORCH_CHECK_VALUE(m.scalar_type() == at::kBool && m.dim() == 1 && m.size(0) == R && m.device().is_cpu(),
                      "mismatch_rows: expected bool [", R, "] on cpu, got ", m.scalar_type(), " ", m.sizes(), " on ",
                      m.device());
  }
  run_params(x, out, lengths, offsets, drift, r2r, scores, comp ? scaffold : c10::nullopt, counters,
             mismatch, only, comp, sink_blocks, local_blocks, n_wit, block_size, structural_cap, sink_tokens,
             scale, grain);
  return {out, counters};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run_layer", &run_layer, "one policy call: checks in C++, drift rows via row_to_request (see cpu_fused.py)");
}
