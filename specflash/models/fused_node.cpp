// One node of DeLS's fused draft tree in one call (specflash/drafters/dels.py, Fusion.step): the
// local head's GRU cell after it reads a token, its readout over the long expert's candidate
// pool, the fusion with the pool's scores, and the fused softmax's argmax and top `width`.
//
// Why native: in PyTorch the same work is about thirty small ops, 0.22 ms a node on the 2-core
// CPU, mostly per-op overhead around a 1536 x 512 matrix-vector product; a draft tree expands
// about seven nodes a step, which made DeLS's drafting step half a target step dearer than
// DFlash's. Here the recurrent product is split over torch's threads (recurrent_step), read in
// float16 where the weights are exactly float16 values, and the rest is a few loops over at most
// a few hundred floats.
//
// The arithmetic is PyTorch's GRU cell (no biases), with sums in another order: outputs match the
// op-by-op path to float rounding. Ties: the argmax is the first maximal index (as torch.argmax),
// the top `width` are ordered by probability, then by index.
//
// Built with the packed kernel (packed_rows.cpp) into one library (specflash/models/packed_kernel.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;
#elif defined(__AVX__)
constexpr int LANES = 8;
#else
constexpr int LANES = 4;
#endif
typedef float lanes __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));

// `LANES` weights as float32 lanes: read as they are, or converted from float16 (a recurrent
// weight saved in float16 holds exactly those values: half the bytes to stream, the same products).
inline lanes load(const float* a) { return *reinterpret_cast<const lanes*>(a); }

inline lanes load(const at::Half* a) {
#if defined(__AVX512F__)
  return (lanes)(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))));
#elif defined(__AVX__) && defined(__F16C__)
  return (lanes)(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
#else
  lanes out;
  for (int i = 0; i < LANES; ++i) out[i] = static_cast<float>(a[i]);
  return out;
#endif
}

// sum_k a[k] * b[k], in one fixed order for either weight type (so float16 weights give the bits
// their float32 copy gives).
template <typename W>
float dot(const W* a, const float* b, int64_t n) {
  lanes acc0{}, acc1{};
  int64_t k = 0;
  for (; k + 2 * LANES <= n; k += 2 * LANES) {
    acc0 += load(a + k) * load(b + k);
    acc1 += load(a + k + LANES) * load(b + k + LANES);
  }
  acc0 += acc1;
  float sum = 0.0f;
  for (int i = 0; i < LANES; ++i) sum += acc0[i];
  for (; k < n; ++k) sum = std::fma(static_cast<float>(a[k]), b[k], sum);
  return sum;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// h' = GRU cell(h = s) for input products g, split over torch's threads by hidden unit: each
// thread reads the r, z and n rows of its units, so the gates need no second pass.
template <typename W>
void recurrent_step(const W* w, const float* g, const float* s, float* hp, int64_t G) {
  at::parallel_for(0, G, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float r = sigmoid(g[j] + dot(w + j * G, s, G));
      const float z = sigmoid(g[G + j] + dot(w + (G + j) * G, s, G));
      const float n = std::tanh(g[2 * G + j] + r * dot(w + (2 * G + j) * G, s, G));
      hp[j] = n + z * (s[j] - n);
    }
  });
}

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.dim() == dim,
              "fused_node: ", name, " must be a contiguous float32 CPU tensor of ", dim, " dimension(s)");
}

// gi [3G]: W_ih x of the token read; state [G] (absent at a block's start: a zero state); w_hh
// [3G, G] (float32, or float16); reads [R, G] and read_bias [R]: the readout table; rows [P]: the
// pool's rows in it (absent: the first P rows), read in place; scores [P]: the pool's
// long - beta * prior. Returns the new state [G], the short logits [P], the fused ones
// [P], and the positions in the pool of the argmax then the top `width` [1 + width] with their
// fused probabilities [1 + width].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_node(
    const at::Tensor& gi, const std::optional<at::Tensor>& state, const at::Tensor& w_hh, const at::Tensor& reads,
    const std::optional<at::Tensor>& read_bias, const std::optional<at::Tensor>& rows, const at::Tensor& scores,
    double alpha, int64_t width) {
  check(gi, "gi", 1);
  TORCH_CHECK((w_hh.scalar_type() == at::kFloat || w_hh.scalar_type() == at::kHalf) && w_hh.device().is_cpu() &&
                  w_hh.is_contiguous() && w_hh.dim() == 2,
              "fused_node: w_hh must be a contiguous float32 or float16 CPU matrix");
  check(reads, "reads", 2);
  check(scores, "scores", 1);
  const int64_t G = w_hh.size(1), P = scores.size(0), R = reads.size(0);
  TORCH_CHECK(w_hh.size(0) == 3 * G && gi.size(0) == 3 * G && reads.size(1) == G && P > 0,
              "fused_node: shapes do not fit (gi ", gi.sizes(), ", w_hh ", w_hh.sizes(), ", reads ", reads.sizes(),
              ", scores ", scores.sizes(), ")");
  const bool has_state = state.has_value() && state->defined();
  const bool has_bias = read_bias.has_value() && read_bias->defined();
  const bool has_rows = rows.has_value() && rows->defined();
  if (has_rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->device().is_cpu() && rows->is_contiguous() &&
                    rows->dim() == 1 && rows->size(0) == P,
                "fused_node: rows must be a contiguous int64 CPU vector, one per score");
    const int64_t* r = rows->data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(r, r + P, [&](int64_t i) { return i >= 0 && i < R; }),
                "fused_node: a pool row is outside the readout table's ", R, " rows");
  } else {
    TORCH_CHECK(R >= P, "fused_node: the readout table has ", R, " rows for a pool of ", P);
  }
  if (has_state) {
    check(*state, "state", 1);
    TORCH_CHECK(state->size(0) == G, "fused_node: state has ", state->size(0), " units, the cell ", G);
  }
  if (has_bias) {
    check(*read_bias, "read_bias", 1);
    TORCH_CHECK(read_bias->size(0) == R, "fused_node: read_bias has ", read_bias->size(0), " rows, the table ", R);
  }
  TORCH_CHECK(width >= 0, "fused_node: width must be >= 0");

  at::Tensor h = at::empty({G}, gi.options());
  const float* g = gi.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  if (!has_state) {
    for (int64_t j = 0; j < G; ++j) {
      const float z = sigmoid(g[G + j]), n = std::tanh(g[2 * G + j]);
      hp[j] = n - z * n;
    }
  } else if (w_hh.scalar_type() == at::kHalf) {
    recurrent_step(w_hh.data_ptr<at::Half>(), g, state->data_ptr<float>(), hp, G);
  } else {
    recurrent_step(w_hh.data_ptr<float>(), g, state->data_ptr<float>(), hp, G);
  }

  at::Tensor short_logits = at::empty({P}, gi.options()), fused = at::empty({P}, gi.options());
  const float* rp = reads.data_ptr<float>();
  const float* bp = has_bias ? read_bias->data_ptr<float>() : nullptr;
  const int64_t* row = has_rows ? rows->data_ptr<int64_t>() : nullptr;
  const float* sc = scores.data_ptr<float>();
  float* sp = short_logits.data_ptr<float>();
  float* fp = fused.data_ptr<float>();
  const float a = static_cast<float>(alpha);
  int64_t best = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t i = row ? row[p] : p;
    sp[p] = dot(rp + i * G, hp, G) + (bp ? bp[i] : 0.0f);
    fp[p] = sc[p] + a * sp[p];
    if (fp[p] > fp[best]) best = p;
  }
  std::vector<float> prob(P);
  float total = 0.0f;
  for (int64_t p = 0; p < P; ++p) total += (prob[p] = std::exp(fp[p] - fp[best]));
  for (int64_t p = 0; p < P; ++p) prob[p] /= total;

  const int64_t k = std::min(width, P);
  std::vector<int64_t> order(P);
  for (int64_t p = 0; p < P; ++p) order[p] = p;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t x, int64_t y) { return prob[x] > prob[y] || (prob[x] == prob[y] && x < y); });
  at::Tensor at_ = at::empty({1 + k}, gi.options().dtype(at::kLong));
  at::Tensor values = at::empty({1 + k}, gi.options());
  int64_t* ap = at_.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  ap[0] = best;
  vp[0] = prob[best];
  for (int64_t i = 0; i < k; ++i) {
    ap[1 + i] = order[i];
    vp[1 + i] = prob[order[i]];
  }
  return {h, short_logits, fused, at_, values};
}

}  // namespace

TORCH_LIBRARY(specflash_fused, m) {
  m.def("fused_node(Tensor gi, Tensor? state, Tensor w_hh, Tensor reads, Tensor? read_bias, Tensor? rows, "
        "Tensor scores, float alpha, int width) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specflash_fused, CPU, m) { m.impl("fused_node", fused_node); }
