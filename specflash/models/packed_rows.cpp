// y[M, N] = x[M, K] . W[N, K]^T for the few rows M of a decoding step, from W packed in panels of
// 32 output rows stored k-major ([N/32][K][32]): each k reads 32 consecutive floats of the panel
// and adds x[m, k] times them into the panel's accumulators for every row m, so the weights
// stream from memory once, in order, and a step of 12 rows costs about what one does.
//
// Every output is one chain of fused multiply-adds over k in order, whatever M is and whichever
// rows share its tile or thread: a row's result is the same bits when computed alone or beside
// others, so verifying a draft reproduces plain decoding's products exactly.
//
// Built at run time for the host CPU (specflash/models/packed_kernel.py), with GCC vector
// extensions: AVX-512, AVX2 and NEON machines each get their own register tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int PANEL = 32;
#if defined(__AVX512F__)
constexpr int VW = 16, ACC_REGS = 24;
#elif defined(__AVX__)
constexpr int VW = 8, ACC_REGS = 12;
#elif defined(__aarch64__)
constexpr int VW = 4, ACC_REGS = 24;
#else
constexpr int VW = 4, ACC_REGS = 12;
#endif
constexpr int J = PANEL / VW;  // vectors per panel row
constexpr int MB_MAX = ACC_REGS / J > 0 ? ACC_REGS / J : 1;
typedef float vec __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float)), may_alias));

// MB rows of x against one panel: y[m][0..width) = sum_k x[m, k] * panel[k][..]. The
// accumulators are only ever read and written whole (never through their address), so they
// stay in registers.
template <int MB>
void tile(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t width) {
  vec acc[MB][J];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    vec w[J];
    for (int j = 0; j < J; ++j) w[j] = *reinterpret_cast<const vec*>(panel + k * PANEL + j * VW);
    for (int m = 0; m < MB; ++m) {
      const float xs = x[m * K + k];
      for (int j = 0; j < J; ++j) acc[m][j] += xs * w[j];
    }
  }
  for (int m = 0; m < MB; ++m) {
    if (width == PANEL) {
      for (int j = 0; j < J; ++j) *reinterpret_cast<vec*>(y + m * ldy + j * VW) = acc[m][j];
    } else {  // the last panel of a weight whose rows are not a multiple of 32
      float row[PANEL];
      for (int j = 0; j < J; ++j) *reinterpret_cast<vec*>(row + j * VW) = acc[m][j];
      std::memcpy(y + m * ldy, row, width * sizeof(float));
    }
  }
}

// The tile for mb rows, 1 <= mb <= N.
template <int N>
void rows_on_panel(int mb, const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t width) {
  if (mb == N) return tile<N>(x, K, panel, y, ldy, width);
  if constexpr (N > 1) rows_on_panel<N - 1>(mb, x, K, panel, y, ldy, width);
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n_out,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear: float32 tensors only");
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous(),
              "packed_linear: weights must come from pack() ([panels, K, 32], contiguous)");
  const int64_t K = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "packed_linear: x has ", x_in.size(-1), " features, the weight ", K);
  TORCH_CHECK(n_out > (panels - 1) * PANEL && n_out <= panels * PANEL, "packed_linear: n_out does not fit the panels");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t width = std::min<int64_t>(PANEL, n_out - p * PANEL);
      for (int64_t m = 0; m < M; m += MB_MAX) {  // the panel stays in cache across row chunks
        const int mb = static_cast<int>(std::min<int64_t>(MB_MAX, M - m));
        rows_on_panel<MB_MAX>(mb, xp + m * K, K, wp + p * K * PANEL, yp + m * n_out + p * PANEL, n_out, width);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  auto sizes = x_in.sizes().vec();
  sizes.back() = n_out;
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY(specflash_rows, m) { m.def("packed_linear(Tensor x, Tensor packed, int n_out, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(specflash_rows, CPU, m) { m.impl("packed_linear", packed_linear); }
