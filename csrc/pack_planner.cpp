// Best-fit-decreasing pack planner: documents -> fixed-size packs of at most S tokens.
//
// Items are placed longest first (stable: ties keep document order). Each goes into the open
// pack whose remaining space is the smallest that still fits; a pack with exactly that much
// space is found in O(log_64 S) with a hierarchical bitset over remaining capacities and a
// stack of packs per capacity (the most recently touched pack of that capacity wins). Items of
// exactly S tokens (whole documents or full chunks of split documents) need no search: each is
// a pack of its own. Packs are then shuffled with a fixed PRNG (splitmix64 + Lemire's unbiased
// bounded draw) so the plan is byte-identical on every machine for the same inputs and seed.
//
// Memory: the sorted order and the pack of each item (int32 when counts allow, else int64),
// plus the output (3 x int64 per segment): about 32 bytes per document.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

enum class LongDocs { kSplit = 0, kTruncate = 1, kDrop = 2 };

struct PlanStats {
  int64_t dropped_tokens = 0, truncated_tokens = 0;
  int64_t dropped_docs = 0, truncated_docs = 0, split_docs = 0, empty_docs = 0;
};

// Successor queries over a set of integers in [0, n): insert, erase, smallest member >= i.
class SuccessorSet {
 public:
  explicit SuccessorSet(int64_t n) {
    int64_t bits = n;
    do {
      int64_t words = (bits + 63) / 64;
      levels_.emplace_back(words, 0);
      bits = words;
    } while (bits > 1);
  }
  void insert(int64_t i) {
    for (auto& level : levels_) {
      level[i >> 6] |= uint64_t{1} << (i & 63);
      i >>= 6;
    }
  }
  void erase(int64_t i) {
    for (auto& level : levels_) {
      level[i >> 6] &= ~(uint64_t{1} << (i & 63));
      if (level[i >> 6] != 0) return;
      i >>= 6;
    }
  }
  int64_t next(int64_t i) const { return next_at(0, i); }

 private:
  int64_t next_at(size_t k, int64_t i) const {
    const auto& level = levels_[k];
    int64_t w = i >> 6;
    if (w >= static_cast<int64_t>(level.size())) return -1;
    uint64_t m = level[w] & (~uint64_t{0} << (i & 63));
    if (m) return (w << 6) + __builtin_ctzll(m);
    if (k + 1 == levels_.size()) return -1;
    int64_t j = next_at(k + 1, w + 1);
    return j < 0 ? -1 : (j << 6) + __builtin_ctzll(level[j]);
  }
  std::vector<std::vector<uint64_t>> levels_;
};

struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) without modulo bias (Lemire 2019).
  uint64_t bounded(uint64_t n) {
    __uint128_t m = static_cast<__uint128_t>(next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

// perm[0..n) = a seeded Fisher-Yates shuffle of 0..n-1.
void shuffle_range(int64_t* perm, int64_t n, uint64_t seed) {
  for (int64_t p = 0; p < n; ++p) perm[p] = p;
  SplitMix64 rng{seed};
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = static_cast<int64_t>(rng.bounded(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
}

// Length of the part of a document that goes through best-fit search (0: none), given S.
inline int64_t residual_length(int64_t len, int64_t S, LongDocs policy) {
  if (len <= 0 || len == S) return 0;
  if (len < S) return len;
  return policy == LongDocs::kSplit ? len % S : 0;
}

inline int64_t full_chunks(int64_t len, int64_t S, LongDocs policy) {
  if (len < S) return 0;
  if (len == S || policy == LongDocs::kSplit) return len / S;
  return policy == LongDocs::kTruncate ? 1 : 0;
}

template <typename Idx>
void plan(const int64_t* lengths, int64_t n, int64_t S, LongDocs policy, uint64_t seed,
          int64_t n_items, int64_t n_full, std::vector<int64_t>& pack_offsets, int64_t* seg) {
  // 1. Counting sort of the residual items by length, longest first, stable in document order.
  std::vector<int64_t> bucket(S + 1, 0);
  for (int64_t d = 0; d < n; ++d) ++bucket[residual_length(lengths[d], S, policy)];
  int64_t pos = 0;
  for (int64_t len = S - 1; len >= 1; --len) {
    int64_t c = bucket[len];
    bucket[len] = pos;
    pos += c;
  }
  std::vector<Idx> order(n_items);
  for (int64_t d = 0; d < n; ++d) {
    int64_t r = residual_length(lengths[d], S, policy);
    if (r) order[bucket[r]++] = static_cast<Idx>(d);
  }
  std::vector<int64_t>().swap(bucket);

  // 2. Best fit: packs with remaining capacity c are a stack threaded through next_in_bucket.
  std::vector<Idx> assign(n_items);
  std::vector<Idx> head(S, Idx(-1)), next_in_bucket, seg_count;
  SuccessorSet open(S);
  for (int64_t i = 0; i < n_items; ++i) {
    int64_t len = residual_length(lengths[order[i]], S, policy);
    int64_t cap = open.next(len);
    Idx p;
    int64_t remaining;
    if (cap < 0) {
      p = static_cast<Idx>(seg_count.size());
      seg_count.push_back(0);
      next_in_bucket.push_back(Idx(-1));
      remaining = S - len;
    } else {
      p = head[cap];
      head[cap] = next_in_bucket[p];
      if (head[cap] == Idx(-1)) open.erase(cap);
      remaining = cap - len;
    }
    assign[i] = p;
    ++seg_count[p];
    if (remaining > 0) {
      next_in_bucket[p] = head[remaining];
      head[remaining] = p;
      open.insert(remaining);
    }
  }
  std::vector<Idx>().swap(head);
  std::vector<Idx>().swap(next_in_bucket);

  // 3. Shuffle pack order (best-fit packs 0..B-1, then one pack per full chunk).
  const int64_t n_bfd = static_cast<int64_t>(seg_count.size());
  const int64_t n_packs = n_bfd + n_full;
  std::vector<int64_t> perm(n_packs);
  shuffle_range(perm.data(), n_packs, seed);
  // cursor[p]: where pack p's next segment goes in the output.
  pack_offsets.assign(n_packs + 1, 0);
  std::vector<int64_t> cursor(n_packs);
  for (int64_t k = 0; k < n_packs; ++k) {
    int64_t p = perm[k];
    cursor[p] = pack_offsets[k];
    pack_offsets[k + 1] = pack_offsets[k] + (p < n_bfd ? static_cast<int64_t>(seg_count[p]) : 1);
  }
  std::vector<int64_t>().swap(perm);

  // 4. Segments (document, start, length), in placement order within each pack.
  for (int64_t i = 0; i < n_items; ++i) {
    int64_t d = order[i], len = lengths[d];
    int64_t r = residual_length(len, S, policy);
    int64_t* out = seg + 3 * cursor[assign[i]]++;
    out[0] = d;
    out[1] = len > S ? len - r : 0;  // split remainder: the document's tail
    out[2] = r;
  }
  int64_t p = n_bfd;
  for (int64_t d = 0; d < n; ++d) {
    int64_t chunks = full_chunks(lengths[d], S, policy);
    for (int64_t c = 0; c < chunks; ++c, ++p) {
      int64_t* out = seg + 3 * cursor[p];
      out[0] = d;
      out[1] = c * S;
      out[2] = S;
    }
  }
}

py::tuple plan_packs(py::array_t<int64_t, py::array::c_style | py::array::forcecast> lengths_arr,
                     int64_t S, int policy_code, uint64_t seed) {
  if (S < 1) throw std::invalid_argument("seq_length must be >= 1, got " + std::to_string(S));
  if (policy_code < 0 || policy_code > 2) throw std::invalid_argument("unknown long_docs policy");
  if (lengths_arr.ndim() != 1) throw std::invalid_argument("lengths must be a 1-D array");
  const LongDocs policy = static_cast<LongDocs>(policy_code);
  const int64_t n = lengths_arr.shape(0);
  const int64_t* lengths = lengths_arr.data();

  // Pass 1: counts (no allocation proportional to n yet).
  PlanStats st;
  int64_t n_items = 0, n_full = 0;
  for (int64_t d = 0; d < n; ++d) {
    int64_t len = lengths[d];
    if (len < 0) throw std::invalid_argument("document " + std::to_string(d) + " has negative length");
    if (len == 0) { ++st.empty_docs; continue; }
    if (len > S) {
      if (policy == LongDocs::kSplit) ++st.split_docs;
      if (policy == LongDocs::kTruncate) { ++st.truncated_docs; st.truncated_tokens += len - S; }
      if (policy == LongDocs::kDrop) { ++st.dropped_docs; st.dropped_tokens += len; }
    }
    n_items += residual_length(len, S, policy) != 0;
    n_full += full_chunks(len, S, policy);
  }
  const int64_t n_segments = n_items + n_full;
  py::array_t<int64_t> segments({n_segments, int64_t{3}});
  int64_t* seg = segments.mutable_data();
  std::vector<int64_t> pack_offsets;
  {
    py::gil_scoped_release release;
    const int64_t int32_max = std::numeric_limits<int32_t>::max();
    if (n < int32_max && n_segments < int32_max)
      plan<int32_t>(lengths, n, S, policy, seed, n_items, n_full, pack_offsets, seg);
    else
      plan<int64_t>(lengths, n, S, policy, seed, n_items, n_full, pack_offsets, seg);
  }
  py::array_t<int64_t> offsets(static_cast<py::ssize_t>(pack_offsets.size()));
  std::copy(pack_offsets.begin(), pack_offsets.end(), offsets.mutable_data());
  py::dict stats;
  stats["dropped_tokens"] = st.dropped_tokens;
  stats["truncated_tokens"] = st.truncated_tokens;
  stats["dropped_docs"] = st.dropped_docs;
  stats["truncated_docs"] = st.truncated_docs;
  stats["split_docs"] = st.split_docs;
  stats["empty_docs"] = st.empty_docs;
  return py::make_tuple(offsets, segments, stats);
}

py::array_t<int64_t> permutation(int64_t n, uint64_t seed) {
  if (n < 0) throw std::invalid_argument("permutation size must be >= 0");
  py::array_t<int64_t> out(n);
  int64_t* perm = out.mutable_data();
  {
    py::gil_scoped_release release;
    shuffle_range(perm, n, seed);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_csrc, m) {
  m.doc() = "Native hot loops for the data layer (see data/packing.py for the typed wrappers).";
  m.def("plan_packs", &plan_packs, py::arg("lengths"), py::arg("seq_length"),
        py::arg("policy"), py::arg("seed"),
        "Best-fit-decreasing pack plan: (pack_offsets[P+1], segments[N,3], stats). "
        "policy: 0 split, 1 truncate, 2 drop.");
  m.def("permutation", &permutation, py::arg("n"), py::arg("seed"),
        "Fisher-Yates permutation of range(n) with splitmix64: identical on every machine.");
}
