// 3x3 convolutions as Winograd F(2x2, 3x3).
//
// Note [Winograd convolution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Winograd's minimal filtering computes a 2x2 block of a 3x3 convolution's output from
// a 4x4 block of its input with 16 multiplications per input-output channel pair
// instead of 36 (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
// 2016):
//   Y = A^T [ (G g G^T) .* (B^T d B) ] A
// with g the 3x3 kernel, d the 4x4 input tile and
//   G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1],
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],  A^T = [1 1 1 0; 0 1 -1 -1].
// Summed over input channels, the element-wise products become 16 independent matrix
// products, one per position xi of the 4x4 transformed tile:
//   M[xi] (out x tiles) = U[xi] (out x in) @ V[xi] (in x tiles),
// which run on oneDNN's sgemm near the core's peak; the transforms are additions only.
// oneDNN 2.6 as Debian builds it offers no Winograd kernel for this CPU (asking for
// convolution_winograd fails), so this file provides one.
//
// Backward-data of a stride-1, padding-1 3x3 convolution is itself such a convolution of
// dy, with the kernel rotated by 180 degrees and its input and output channels swapped,
// so both directions share the code below.
//
// The weight gradient follows from the same formula. For one tile, the gradient of the
// element-wise product Z = U .* V is A dY A^T (a 4x4 tile from the 2x2 output
// gradient, zero where the tile leaves the map), so that of U is (A dY A^T) .* V, and
// that of the kernel G^T dU G. Summed over every tile of every image, again one matrix
// product per position:
//   dU[xi] (out x in) = Mdy[xi] (out x tiles) @ V[xi]^T (tiles x in),
// with V the forward's input transform. run_weights() goes through the same chunks as
// run(), adding each chunk's product into dU; a thread's share of the batch sums into
// a dU of its own, added to the others in a fixed order at the end, so the result
// depends on the thread count only through that grouping (as oneDNN's does).
//
// Layout: blocks of sixteen images go through the lanes layout of conv_support.h
// (Note [Images in the vector lanes] in conv_lanes.cpp), zero-padded, so the
// transforms are plain vector additions with one image per lane; the columns of V and
// M are (tile, lane) pairs. A block goes through in chunks of whole tile rows, as many
// as fit in 128 columns and at least one (one row of 224 columns at 28x28, of 112 at
// 14x14; maps narrower than the rule admits take several): the chunk's input rows are
// copied in, transformed,
// multiplied and transformed back, and its output rows copied out, so V and M stay in
// the core's cache and the per-thread buffers hold one chunk (2.5 MB for 64 channels
// at 28x28; a whole block of images took 8.7 MB and 10 MiB more peak RSS in training).
//
// Measured with tests/tensor/bench_kernels (1 thread, batch 64, process CPU ms per
// call, two runs; oneDNN in its blocked layout, reorders included):
//
//                        forward               backward-data
//                        oneDNN    Winograd    oneDNN    Winograd
//   64 -> 64 @28         37-40     27-31       36-40     28-29
//   128 -> 128 @14       32-37     22-26       35-39     22-27
//   256 -> 256 @7        29-31     30          29-31     30-31
//   32 -> 32 @28         9.6-10.7  8.9-10.2    11.1-11.3 9.2
//   32 -> 48 @16         4.5-4.8   3.7-4.2     4.4-5.2   3.8-4.7
//
// At 7x7 a fourth of the tiles' area lies outside the map and the win is gone, so on
// AVX-512 cores (where the table above was measured; cpu_has_avx512())
// winograd_applies() takes maps of at least 14 pixels each way and 32 channels either
// side. ResNet-18 on 28x28 images, 1 rank, batch 64: 34.4-37.0 img/s before, 38.9-39.6
// after, +7 to +13 % in three interleaved pairs of scripts/bench-ddp.sh --models
// resnet18 --nprocs 1 --runs 1 --no-torch --no-sync-bn --bin-dir DIR; peak RSS 426 ->
// 430-431 MiB. The kernel itself handles any map; the tests also run narrow ones
// through it directly.
//
// CPUs with AVX2 and FMA but no AVX-512 run the x86-64-v3 clones, and there the rule
// differs: at least 128 channels either side, maps of 4 to 16 pixels each way. Measured
// on a Zen 3 EPYC on 2026-11-26 with `bench_kernels 1 256 64 cpu` (batch 64, process
// CPU ms per call, three or four runs, each row's two columns from the same run; that
// VM's spread between runs is wide):
//
//                        forward               backward-data
//                        oneDNN    Winograd    oneDNN    Winograd
//   512 -> 512 @4        67-69     49-52       85-108    49-53
//   256 -> 256 @7        49-80     38-51       43-65     38-51
//   128 -> 128 @14       47-63     34-42       44-56     34-42
//   128 -> 128 @16       81-82     47-78       57-71     48-66
//   128 -> 128 @28       180-214   163-240     172-197   161-223
//   64 -> 64 @28         47-63     46-75       47-55     46-68
//   64 -> 64 @14         13-15     15-17       13-16     12-17
//   32 -> 32 @14         3.5-4.8   4.0-7.3     3.0-4.3   4.2-6.8
//
// Fewer channels and larger maps stay with oneDNN there. ResNet-18 on 28x28 images
// (its 128-, 256- and 512-channel layers at 14, 7 and 4 pixels), 1 rank, batch 64,
// median of steps 3-10 (`mtrain-train --model resnet18 --batch-size 64 --threads 1
// --no-eval --max-steps 10 --log-every 1 --momentum 0 --no-shuffle --metrics FILE`):
// without Winograd against Winograd on every 3x3 layer of 32 or more channels,
// alternating, 3.06 / 2.89, 3.08 / 2.89, 3.13 / 2.59, 3.63 / 3.17, 3.32 / 2.83 s
// (faster in all five pairs; median of the pairs' changes -13 %); that against this rule, 2.61 / 3.16,
// 2.96 / 2.77, 2.74 / 2.58, 2.94 / 3.05 s, a difference the VM cannot show, so the rule
// keeps to what the kernels measured.
//
// The weight gradient, measured the same way (Winograd on every 3x3 layer of 32 or
// more channels; oneDNN in its blocked layout, or for 4x4 maps the GEMM of Note
// [Weight gradients as a GEMM], whose figures are the Auto column of earlier runs):
//
//                        oneDNN / GEMM    Winograd
//   512 -> 512 @4        GEMM 71-96       45-63
//   256 -> 256 @7        59-83            44-62
//   128 -> 128 @14       62-74            39-65
//   128 -> 128 @16       88-108           70-108
//   128 -> 128 @28       238-261          268-341
//   64 -> 64 @28         61-78            54-93
//   64 -> 64 @14         20-22            14-20
//
// It wins from 128 channels at 4 to 14 pixels (clearly at 4 and 7, in two runs of three
// at 14), loses at 28, and is even at 128 @16 and 64 @28 (64 @14 may win, but that
// shape is in no network measured here).
// winograd_weights_applies() takes the same shapes as winograd_applies() on such CPUs,
// a choice that keeps one rule for the three directions; with AVX-512 (not measured)
// weight gradients stay with oneDNN and the GEMM. ResNet-18, the command above, with
// the forward and backward-data rule above in both builds, without and with Winograd
// weight gradients under this rule, alternating: 2.86 / 2.34, 2.77 / 2.26,
// 2.76 / 2.30, 2.98 / 2.60, 3.24 / 3.12 s (faster in all five pairs; median of the
// pairs' changes -17 %). Peak RSS did not grow: 406 MiB in the pass of
// scripts/bench-ddp.sh after it against 414 MiB in the passes before, the GEMM's
// buffers for the 4x4 layers being gone (docs/benchmarks.md).
// Without AVX2 and FMA, oneDNN runs all of them.
//
// Numerics: the transforms scale by 1/2 and add. Against a double-precision reference
// the relative RMS error measured 2.6e-7 / 3.6e-7 (64 / 128 channels) against oneDNN's
// 2.1e-7 / 2.2e-7, the largest error 1.6e-5 / 2.2e-5 against 1.4e-5 / 1.4e-5; the
// tests hold it to the tolerance of every other convolution path. Each image's result
// depends only on that image (not on its lane, the batch or the thread count): run()
// keeps oneDNN's sgemm on one thread (SequentialSgemm), which outside an active
// parallel region, with a batch of at most sixteen, could otherwise take all threads
// and split its sums differently. Weight gradients against the same reference (ResNet's
// 128 @14, 256 @7 and 512 @4 layers, batches of 16, 16 and 32): relative RMS error
// 3.5e-7 / 3.5e-7 / 2.8e-7 against oneDNN's 9.6e-7 / 4.6e-7 / 3.4e-7, the largest
// 3.4e-5 / 2.2e-5 / 1.3e-5 against 1.7e-4 / 4.6e-5 / 2.8e-5.
#include "tensor/cpu/conv_winograd.h"

#include <omp.h>

#include <algorithm>

#include "tensor/cpu/conv_support.h"
#include "tensor/cpu/dnnl_support.h"
#include "tensor/tensor.h"

namespace mtrain::ops::cpu {
namespace {

constexpr int64_t kPositions = 16;      // 4x4 transformed tile
constexpr int64_t kTargetColumns = 128;  // (tile, lane) columns per chunk
// winograd_applies()'s reach, per instruction set (Note [Winograd convolution]).
constexpr int64_t kMinChannelsAvx512 = 32;
constexpr int64_t kMinSideAvx512 = 14;
constexpr int64_t kMinChannelsAvx2 = 128;
constexpr int64_t kMinSideAvx2 = 4;
constexpr int64_t kMaxSideAvx2 = 16;

// Sets the calling thread's OpenMP thread count to one for its lifetime. Parallel
// regions that ask for a number of threads (for_each_part) still get them, but oneDNN's
// sgemm, which sizes itself by omp_get_max_threads() when called outside an active
// region, runs on one thread; so do calls inside the region's threads, which inherit
// the setting.
class SequentialSgemm {
 public:
  SequentialSgemm() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SequentialSgemm() { omp_set_num_threads(before_); }
  SequentialSgemm(const SequentialSgemm&) = delete;
  SequentialSgemm& operator=(const SequentialSgemm&) = delete;

 private:
  int before_;
};

// U[xi][co][ci] = G g G^T for g the kernel from input channel ci to output channel co.
// Forward: g = w[co][ci]. Backward-data (input channels = the convolution's outputs):
// g = w[ci][co] rotated by 180 degrees.
void transform_weights(const float* w, int64_t o, int64_t c, bool backward, float* u) {
  const int64_t cout = backward ? c : o;
  const int64_t cin = backward ? o : c;
#pragma omp parallel for if (cout * cin > 4096)
  for (int64_t co = 0; co < cout; ++co) {
    for (int64_t ci = 0; ci < cin; ++ci) {
      float g[3][3];
      const float* k = backward ? w + (ci * c + co) * 9 : w + (co * c + ci) * 9;
      for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 3; ++j) g[i][j] = backward ? k[(2 - i) * 3 + (2 - j)] : k[i * 3 + j];
      }
      float t[4][3];  // G g
      for (int j = 0; j < 3; ++j) {
        t[0][j] = g[0][j];
        t[1][j] = 0.5f * (g[0][j] + g[1][j] + g[2][j]);
        t[2][j] = 0.5f * (g[0][j] - g[1][j] + g[2][j]);
        t[3][j] = g[2][j];
      }
      for (int i = 0; i < 4; ++i) {  // (G g) G^T
        const float r[4] = {t[i][0], 0.5f * (t[i][0] + t[i][1] + t[i][2]),
                            0.5f * (t[i][0] - t[i][1] + t[i][2]), t[i][2]};
        for (int j = 0; j < 4; ++j) u[((i * 4 + j) * cout + co) * cin + ci] = r[j];
      }
    }
  }
}

struct Geometry {
  int64_t cin, cout, h, w;
  int64_t th, tw;      // tile rows and columns: ceil(h / 2), ceil(w / 2)
  int64_t row;         // padded input row: 2 tw + 2 pixels (one more zero column when w is odd)
  int64_t chunk_rows;  // tile rows per chunk
  int64_t in_rows() const { return 2 * chunk_rows + 2; }  // padded input rows of a chunk
  int64_t max_cols() const { return chunk_rows * tw * kLanes; }
};

Geometry geometry_of(int64_t cin, int64_t cout, int64_t h, int64_t w) {
  const int64_t th = (h + 1) / 2, tw = (w + 1) / 2;
  return {cin, cout, h, w, th, tw, 2 * tw + 2, std::clamp<int64_t>(kTargetColumns / (tw * kLanes), 1, th)};
}

// V[xi][ci][col] = B^T d B for n tile rows, xl the chunk's padded input
// [cin][2 n + 2][row][16]; col = (r * tw + t) * 16 + lane.
MTRAIN_CLONES void input_transform(const Geometry& g, const float* xl, int64_t n, float* v, int64_t cols) {
  const int64_t step = g.cin * cols;  // from one position xi to the next
  for (int64_t ci = 0; ci < g.cin; ++ci) {
    for (int64_t r = 0; r < n; ++r) {
      const float* top = xl + (ci * g.in_rows() + 2 * r) * g.row * kLanes;
      for (int64_t t = 0; t < g.tw; ++t) {
        Vec d[4][4];
        for (int i = 0; i < 4; ++i) {
          for (int j = 0; j < 4; ++j) load(d[i][j], top + (i * g.row + 2 * t + j) * kLanes);
        }
        Vec b[4][4];  // B^T d
        for (int j = 0; j < 4; ++j) {
          b[0][j] = d[0][j] - d[2][j];
          b[1][j] = d[1][j] + d[2][j];
          b[2][j] = d[2][j] - d[1][j];
          b[3][j] = d[1][j] - d[3][j];
        }
        float* out = v + ci * cols + (r * g.tw + t) * kLanes;
        for (int i = 0; i < 4; ++i) {  // (B^T d) B
          store(out + (i * 4 + 0) * step, b[i][0] - b[i][2]);
          store(out + (i * 4 + 1) * step, b[i][1] + b[i][2]);
          store(out + (i * 4 + 2) * step, b[i][2] - b[i][1]);
          store(out + (i * 4 + 3) * step, b[i][1] - b[i][3]);
        }
      }
    }
  }
}

// yl[co][y][x][16] = A^T M A (+ bias) for the same tiles: the chunk's first out_rows
// output rows (2 n, or fewer at the bottom of an odd-sized map); a last tile column
// half outside an odd-sized map drops its outside half.
MTRAIN_CLONES void output_transform(const Geometry& g, const float* m, int64_t n, int64_t cols,
                                    int64_t out_rows, const float* bias, float* yl) {
  const int64_t step = g.cout * cols;
  for (int64_t co = 0; co < g.cout; ++co) {
    const Vec b = Vec{} + (bias ? bias[co] : 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t t = 0; t < g.tw; ++t) {
        const float* in = m + co * cols + (r * g.tw + t) * kLanes;
        Vec s[2][4];  // A^T M
        for (int j = 0; j < 4; ++j) {
          Vec m0, m1, m2, m3;
          load(m0, in + (0 * 4 + j) * step);
          load(m1, in + (1 * 4 + j) * step);
          load(m2, in + (2 * 4 + j) * step);
          load(m3, in + (3 * 4 + j) * step);
          s[0][j] = m0 + m1 + m2;
          s[1][j] = m1 - m2 - m3;
        }
        for (int a = 0; a < 2 && 2 * r + a < out_rows; ++a) {  // (A^T M) A
          float* out = yl + ((co * out_rows + 2 * r + a) * g.w + 2 * t) * kLanes;
          store(out, s[a][0] + s[a][1] + s[a][2] + b);
          if (2 * t + 1 < g.w) store(out + kLanes, s[a][1] - s[a][2] - s[a][3] + b);
        }
      }
    }
  }
}

// Mdy[xi][co][col] = A dy A^T for the chunk's n tile rows, dyl the chunk's output
// gradient [cout][2 chunk_rows][2 tw][16], zero outside the map: the gradient of the
// element-wise product in Y = A^T (U .* V) A with respect to that product.
MTRAIN_CLONES void gradient_transform(const Geometry& g, const float* dyl, int64_t n, int64_t cols, float* mdy) {
  const int64_t step = g.cout * cols;
  const int64_t row = 2 * g.tw;
  const int64_t plane = 2 * g.chunk_rows * row;
  for (int64_t co = 0; co < g.cout; ++co) {
    for (int64_t r = 0; r < n; ++r) {
      const float* top = dyl + (co * plane + 2 * r * row) * kLanes;
      for (int64_t t = 0; t < g.tw; ++t) {
        Vec d[2][2];
        for (int a = 0; a < 2; ++a) {
          for (int b = 0; b < 2; ++b) load(d[a][b], top + (a * row + 2 * t + b) * kLanes);
        }
        Vec e[4][2];  // A d, A = [1 0; 1 1; 1 -1; 0 -1]
        for (int b = 0; b < 2; ++b) {
          e[0][b] = d[0][b];
          e[1][b] = d[0][b] + d[1][b];
          e[2][b] = d[0][b] - d[1][b];
          e[3][b] = -d[1][b];
        }
        float* out = mdy + co * cols + (r * g.tw + t) * kLanes;
        for (int i = 0; i < 4; ++i) {  // (A d) A^T
          store(out + (i * 4 + 0) * step, e[i][0]);
          store(out + (i * 4 + 1) * step, e[i][0] + e[i][1]);
          store(out + (i * 4 + 2) * step, e[i][0] - e[i][1]);
          store(out + (i * 4 + 3) * step, -e[i][1]);
        }
      }
    }
  }
}

// dw[co][ci] (+)= G^T dU[.][co][ci] G, the kernel gradient from the gradient of its
// transform U = G g G^T.
void weights_from_transformed(const float* du, int64_t cout, int64_t cin, bool accumulate, float* dw) {
#pragma omp parallel for if (cout * cin > 4096)
  for (int64_t co = 0; co < cout; ++co) {
    for (int64_t ci = 0; ci < cin; ++ci) {
      float u[4][4];
      for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j) u[i][j] = du[((i * 4 + j) * cout + co) * cin + ci];
      }
      float t[3][4];  // G^T dU
      for (int j = 0; j < 4; ++j) {
        t[0][j] = u[0][j] + 0.5f * (u[1][j] + u[2][j]);
        t[1][j] = 0.5f * (u[1][j] - u[2][j]);
        t[2][j] = 0.5f * (u[1][j] + u[2][j]) + u[3][j];
      }
      float* k = dw + (co * cin + ci) * 9;
      for (int i = 0; i < 3; ++i) {  // (G^T dU) G
        const float r[3] = {t[i][0] + 0.5f * (t[i][1] + t[i][2]), 0.5f * (t[i][1] - t[i][2]),
                            0.5f * (t[i][1] + t[i][2]) + t[i][3]};
        for (int j = 0; j < 3; ++j) k[i * 3 + j] = accumulate ? k[i * 3 + j] + r[j] : r[j];
      }
    }
  }
}

// V for tile rows [r0, r0 + rows) of block b of in[n, cin, h, w]: the chunk's input
// rows go into xl (the padded lanes layout of input_transform, whose left and right
// padding columns the caller has zeroed once), then through the input transform.
void transform_input_chunk(const Geometry& g, const float* in, int64_t n, int64_t b, int64_t r0, int64_t rows,
                           float* xl, float* v) {
  const size_t plane = static_cast<size_t>(g.in_rows() * g.row * kLanes);
  const size_t line = static_cast<size_t>(g.row * kLanes);
  // Padded rows 2 r0 .. 2 (r0 + rows) + 1 are image rows 2 r0 - 1 .. 2 (r0 + rows);
  // those outside the image are the zero padding.
  const int64_t first = std::max<int64_t>(0, 2 * r0 - 1);
  const int64_t last = std::min(g.h, 2 * (r0 + rows) + 1);
  const int64_t top = first - (2 * r0 - 1);
  for (int64_t ci = 0; ci < g.cin; ++ci) {
    float* p = xl + ci * plane;
    std::fill(p, p + top * line, 0.0f);
    std::fill(p + (top + last - first) * line, p + (2 * rows + 2) * line, 0.0f);
  }
  to_lanes(in, n, b * kLanes, g.cin, {g.h, g.w, first, last - first}, {g.in_rows(), g.row, top, 1}, xl);
  input_transform(g, xl, rows, v, rows * g.tw * kLanes);
}

// One part's buffers for a chunk: the input rows in lanes (`xl`), the output or
// output-gradient rows in lanes (`rows`, of `rows_floats` floats), and the transformed
// V and M. ChunkScratch lays out every part's in one thread_scratch buffer, taken by
// the calling thread before the parts start; run() and run_weights() share the layout.
struct ChunkBuffers {
  float* xl;
  float* rows;
  float* v;
  float* m;
  size_t xl_floats;
  size_t rows_floats;
};

class ChunkScratch {
 public:
  ChunkScratch(const Geometry& g, size_t rows_floats, int parts)
      : xl_floats_(static_cast<size_t>(g.cin * g.in_rows() * g.row * kLanes)),
        rows_floats_(rows_floats),
        v_floats_(static_cast<size_t>(kPositions * g.cin * g.max_cols())),
        per_part_(xl_floats_ + rows_floats_ + v_floats_ + static_cast<size_t>(kPositions * g.cout * g.max_cols())),
        base_(thread_scratch(per_part_ * static_cast<size_t>(parts))) {}

  ChunkBuffers part(int p) const {
    float* xl = base_ + per_part_ * static_cast<size_t>(p);
    float* rows = xl + xl_floats_;
    float* v = rows + rows_floats_;
    return {xl, rows, v, v + v_floats_, xl_floats_, rows_floats_};
  }

 private:
  size_t xl_floats_, rows_floats_, v_floats_, per_part_;
  float* base_;
};

// out[n, cout, h, w] = the stride-1, padding-1 3x3 convolution of in[n, cin, h, w]
// whose transformed kernels are u (+ bias). Each block of sixteen images goes through
// in chunks of tile rows: the chunk's input rows (with the rows above and below it that
// its tiles overlap) are copied into the lanes layout, transformed, multiplied and
// transformed back, and its output rows copied out, so the per-thread buffers hold one
// chunk, not a whole block of images.
void run(const float* in, int64_t n, const float* u, const float* bias, float* out, const Geometry& g) {
  const int64_t blocks = blocks_of(n);
  const int nthreads = threads_for(blocks);
  const ChunkScratch scratch(g, static_cast<size_t>(g.cout * 2 * g.chunk_rows * g.w * kLanes), nthreads);
  const SequentialSgemm sequential;
  for_each_part(blocks, nthreads, [&](int part, int64_t first_block, int64_t last_block) {
    const ChunkBuffers buf = scratch.part(part);
    float* xl = buf.xl;
    float* yl = buf.rows;
    float* v = buf.v;
    float* m = buf.m;
    // The left and right padding columns (and the extra one of an odd width) stay zero.
    std::fill(xl, xl + buf.xl_floats, 0.0f);
    for (int64_t b = first_block; b < last_block; ++b) {
      for (int64_t r0 = 0; r0 < g.th; r0 += g.chunk_rows) {
        const int64_t rows = std::min(g.chunk_rows, g.th - r0);
        const int64_t cols = rows * g.tw * kLanes;
        transform_input_chunk(g, in, n, b, r0, rows, xl, v);
        for (int64_t xi = 0; xi < kPositions; ++xi) {
          sgemm(false, false, g.cout, cols, g.cin, 1.0f, u + xi * g.cout * g.cin, v + xi * g.cin * cols,
                0.0f, m + xi * g.cout * cols);
        }
        const int64_t out_rows = std::min(2 * rows, g.h - 2 * r0);
        output_transform(g, m, rows, cols, out_rows, bias, yl);
        from_lanes(yl, n, b * kLanes, g.cout, {g.h, g.w, 2 * r0, out_rows}, out);
      }
    }
  });
}

// dU[xi][co][ci] = sum over every tile of every image of Mdy[xi][co][.] V[xi][ci][.]:
// the chunks of each block of sixteen images as in run(), with the output gradient
// transformed instead of the output, and one sgemm per position adding the chunk's
// columns. Each part of the batch sums into its own dU; the parts are then added in
// order, so the result depends on the thread count only through that grouping.
void run_weights(const float* x, const float* dy, int64_t n, const Geometry& g, float* du) {
  const int64_t blocks = blocks_of(n);
  const int nthreads = threads_for(blocks);
  const int64_t dy_row = 2 * g.tw;
  const size_t dyl_plane = static_cast<size_t>(2 * g.chunk_rows * dy_row * kLanes);
  const ChunkScratch scratch(g, static_cast<size_t>(g.cout) * dyl_plane, nthreads);
  const size_t du_floats = static_cast<size_t>(kPositions * g.cout * g.cin);
  // Part 0 sums into du itself, the others into parts of their own.
  Tensor partials = Tensor::empty({static_cast<int64_t>(du_floats) * std::max(0, nthreads - 1)});
  const SequentialSgemm sequential;
  for_each_part(blocks, nthreads, [&](int part, int64_t first_block, int64_t last_block) {
    const ChunkBuffers buf = scratch.part(part);
    float* xl = buf.xl;
    float* dyl = buf.rows;
    float* v = buf.v;
    float* m = buf.m;
    float* sum = part == 0 ? du : partials.data<float>() + du_floats * static_cast<size_t>(part - 1);
    bool first_product = true;
    std::fill(xl, xl + buf.xl_floats, 0.0f);
    std::fill(dyl, dyl + buf.rows_floats, 0.0f);  // the column past an odd width stays zero
    for (int64_t b = first_block; b < last_block; ++b) {
      for (int64_t r0 = 0; r0 < g.th; r0 += g.chunk_rows) {
        const int64_t rows = std::min(g.chunk_rows, g.th - r0);
        const int64_t cols = rows * g.tw * kLanes;
        transform_input_chunk(g, x, n, b, r0, rows, xl, v);
        // The chunk's output-gradient rows; below an odd-sized map's last row, zeros.
        const int64_t out_rows = std::min(2 * rows, g.h - 2 * r0);
        for (int64_t co = 0; co < g.cout; ++co) {
          float* p = dyl + static_cast<size_t>(co) * dyl_plane;
          std::fill(p + out_rows * dy_row * kLanes, p + 2 * rows * dy_row * kLanes, 0.0f);
        }
        to_lanes(dy, n, b * kLanes, g.cout, {g.h, g.w, 2 * r0, out_rows}, {2 * g.chunk_rows, dy_row, 0, 0}, dyl);
        gradient_transform(g, dyl, rows, cols, m);
        for (int64_t xi = 0; xi < kPositions; ++xi) {
          sgemm(false, true, g.cout, g.cin, cols, 1.0f, m + xi * g.cout * cols, v + xi * g.cin * cols,
                first_product ? 0.0f : 1.0f, sum + xi * g.cout * g.cin);
        }
        first_product = false;
      }
    }
    if (first_product) std::fill(sum, sum + du_floats, 0.0f);  // no chunk ran (an empty map)
  });
  for (int part = 1; part < nthreads; ++part) {
    const float* p = partials.data<float>() + du_floats * static_cast<size_t>(part - 1);
    for (size_t i = 0; i < du_floats; ++i) du[i] += p[i];
  }
}

// Forward (y from x) or backward-data (dx from dy) of the convolution with weights w.
// The transformed kernels live in a tensor from the caching allocator; thread_scratch
// holds run()'s buffers (and run_weights()'s).
void convolve(const float* in, const float* w, const float* bias, float* out, const ConvGeometry& s,
              bool backward) {
  Tensor u = Tensor::empty({kPositions * s.o * s.c});
  transform_weights(w, s.o, s.c, backward, u.data<float>());
  run(in, s.n, u.data<float>(), bias, out,
      backward ? geometry_of(s.o, s.c, s.h, s.w) : geometry_of(s.c, s.o, s.h, s.w));
}

}  // namespace

namespace {
bool is_3x3_same(const ConvGeometry& s) {
  return s.kh == 3 && s.kw == 3 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 1 && s.pad_w == 1;
}

bool avx2_rule(const ConvGeometry& s) {
  return std::min(s.c, s.o) >= kMinChannelsAvx2 && std::min(s.h, s.w) >= kMinSideAvx2 &&
         std::max(s.h, s.w) <= kMaxSideAvx2;
}
}  // namespace

bool winograd_applies(const ConvGeometry& s) {
  if (!is_3x3_same(s)) return false;
  if (cpu_has_avx512()) return std::min(s.c, s.o) >= kMinChannelsAvx512 && std::min(s.h, s.w) >= kMinSideAvx512;
  return cpu_has_x86_64_v3() && avx2_rule(s);
}

bool winograd_weights_applies(const ConvGeometry& s) {
  return is_3x3_same(s) && !cpu_has_avx512() && cpu_has_x86_64_v3() && avx2_rule(s);
}

void winograd_conv_forward(const float* x, const float* w, const float* b, float* y,
                           const ConvGeometry& s) {
  convolve(x, w, b, y, s, /*backward=*/false);
}

void winograd_conv_backward_weights(const float* x, const float* dy, float* dw, bool accumulate,
                                    const ConvGeometry& s) {
  Tensor du = Tensor::empty({kPositions * s.o * s.c});
  run_weights(x, dy, s.n, geometry_of(s.c, s.o, s.h, s.w), du.data<float>());
  weights_from_transformed(du.data<float>(), s.o, s.c, accumulate, dw);
}

void winograd_conv_backward_data(const float* dy, const float* w, float* dx, const ConvGeometry& s) {
  convolve(dy, w, nullptr, dx, s, /*backward=*/true);
}

}  // namespace mtrain::ops::cpu
