// Kernel micro-benchmark for the shapes mtrain trains (Fashion-MNIST 28x28, LeNet and
// the d2l ResNet-18). Built with the tests, not registered as one: run it by hand,
//   build/tests/bench_kernels [threads=2] [lenet_batch=256] [resnet_batch=128] [wall|cpu] [only]
// It prints the median milliseconds per call for each op, and for convolutions both
// oneDNN layouts (see Note [Convolution layout] in tensor/cpu/conv.cpp). `cpu` times
// with the process CPU clock instead of the wall clock: with threads=1 that measures
// the work itself and stays meaningful on a machine busy with other jobs. With `only`,
// just the convolutions whose name contains it run (for a profiler).
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tensor/cpu/conv_layout.h"
#include "tensor/ops.h"

using namespace mtrain;
using ops::cpu::ConvLayout;

namespace {

Tensor random(const Shape& shape) {
  static std::mt19937 gen(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(gen);
  return t;
}

bool use_cpu_clock = false;

double now_ms() {
  if (!use_cpu_clock) {
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

// Median over `reps` timed calls after two warm-up calls (which create primitives).
double median_ms(const std::function<void()>& fn, int reps) {
  fn();
  fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_ms();
    fn();
    ms.push_back(now_ms() - t0);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct ConvCase {
  const char* name;
  int64_t n, c, h, o, k;
  ops::Conv2dParams p;
};

void bench_conv(const ConvCase& cc, int reps) {
  const Tensor x = random({cc.n, cc.c, cc.h, cc.h});
  const Tensor w = random({cc.o, cc.c, cc.k, cc.k});
  const Tensor b = random({cc.o});
  const int64_t oh = ops::conv_out_size(cc.h, cc.k, cc.p.stride_h, cc.p.pad_h);
  Tensor y = Tensor::empty({cc.n, cc.o, oh, oh});
  const Tensor dy = random(y.shape());
  Tensor dx = Tensor::empty(x.shape()), dw = Tensor::empty(w.shape()), db = Tensor::empty({cc.o});
  double t[2][3];
  for (ConvLayout layout : {ConvLayout::Plain, ConvLayout::Blocked}) {
    ops::cpu::set_conv_layout(layout);
    const int l = layout == ConvLayout::Plain ? 0 : 1;
    t[l][0] = median_ms([&] { ops::conv2d_forward(x, w, b, y, cc.p); }, reps);
    t[l][1] = median_ms([&] { ops::conv2d_backward_data(dy, w, dx, cc.p); }, reps);
    t[l][2] = median_ms([&] { ops::conv2d_backward_weights(x, dy, dw, db, cc.p, true); }, reps);
  }
  ops::cpu::set_conv_layout(ConvLayout::Auto);
  double a[3];
  a[0] = median_ms([&] { ops::conv2d_forward(x, w, b, y, cc.p); }, reps);
  a[1] = median_ms([&] { ops::conv2d_backward_data(dy, w, dx, cc.p); }, reps);
  a[2] = median_ms([&] { ops::conv2d_backward_weights(x, dy, dw, db, cc.p, true); }, reps);
  std::printf("%-34s plain %8.2f %8.2f %8.2f | blocked %8.2f %8.2f %8.2f | auto %8.2f %8.2f %8.2f\n",
              cc.name, t[0][0], t[0][1], t[0][2], t[1][0], t[1][1], t[1][2], a[0], a[1], a[2]);
}

void row(const char* name, double ms) { std::printf("%-34s %8.3f ms\n", name, ms); }

// dnnl::matmul primitive (created once) for comparison with dnnl_sgemm behind ops::matmul.
double matmul_primitive_ms(const Tensor& a, const Tensor& b, Tensor& c, int reps) {
  using dnnl::memory;
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const memory::desc amd({a.size(0), a.size(1)}, memory::data_type::f32, memory::format_tag::ab);
  // b is [O, I] used transposed: describe it as [I, O] with "ba" strides.
  const memory::desc bmd({b.size(1), b.size(0)}, memory::data_type::f32, memory::format_tag::ba);
  const memory::desc cmd({c.size(0), c.size(1)}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(amd, bmd, cmd), eng));
  memory am(amd, eng, a.raw_data()), bm(bmd, eng, b.raw_data()), cm(cmd, eng, c.raw_data());
  return median_ms([&] {
    prim.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    s.wait();
  }, reps);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int64_t lenet_batch = argc > 2 ? std::atoll(argv[2]) : 256;
  const int64_t resnet_batch = argc > 3 ? std::atoll(argv[3]) : 128;
  use_cpu_clock = argc > 4 && std::string(argv[4]) == "cpu";
  if (threads < 1 || lenet_batch < 1 || resnet_batch < 1) {
    std::fprintf(stderr, "bench_kernels: threads and batch sizes must be >= 1, got %d %lld %lld\n",
                 threads, static_cast<long long>(lenet_batch), static_cast<long long>(resnet_batch));
    return 2;
  }
  ops::set_num_threads(threads);
  std::printf("threads=%d lenet_batch=%lld resnet_batch=%lld (median %s ms per call)\n", threads,
              static_cast<long long>(lenet_batch), static_cast<long long>(resnet_batch),
              use_cpu_clock ? "process-CPU" : "wall");
  std::printf("%-34s       %8s %8s %8s\n", "convolution", "fwd", "bwd_data", "bwd_w");
  const int64_t nl = lenet_batch, nr = resnet_batch;
  const std::vector<ConvCase> convs = {
      {"lenet conv1 1->6 5x5 p2 @28", nl, 1, 28, 6, 5, {1, 1, 2, 2}},
      {"lenet conv2 6->16 5x5 @14", nl, 6, 14, 16, 5, {1, 1, 0, 0}},
      // Few-channel shapes beside LeNet's, for the reach of Note [Images in the vector lanes].
      {"few 3->16 3x3 p1 @32", nl, 3, 32, 16, 3, {1, 1, 1, 1}},
      {"one 1->8 3x3 p1 @28", nl, 1, 28, 8, 3, {1, 1, 1, 1}},
      {"one 1->16 5x5 p2 @28", nl, 1, 28, 16, 5, {1, 1, 2, 2}},
      {"one 1->4 7x7 p3 @28", nl, 1, 28, 4, 7, {1, 1, 3, 3}},
      {"few 8->16 5x5 p2 @28", nl, 8, 28, 16, 5, {1, 1, 2, 2}},
      {"few 16->16 3x3 p1 @28", nl, 16, 28, 16, 3, {1, 1, 1, 1}},
      {"few 16->32 3x3 p1 @14", nl, 16, 14, 32, 3, {1, 1, 1, 1}},
      {"few 16->32 5x5 @12", nl, 16, 12, 32, 5, {1, 1, 0, 0}},
      {"resnet stem 1->64 3x3 @28", nr, 1, 28, 64, 3, {1, 1, 1, 1}},
      {"resnet 64->64 3x3 @28", nr, 64, 28, 64, 3, {1, 1, 1, 1}},
      {"resnet 64->128 3x3 s2 @28", nr, 64, 28, 128, 3, {2, 2, 1, 1}},
      {"resnet 64->128 1x1 s2 @28", nr, 64, 28, 128, 1, {2, 2, 0, 0}},
      {"resnet 128->128 3x3 @14", nr, 128, 14, 128, 3, {1, 1, 1, 1}},
      {"resnet 128->256 3x3 s2 @14", nr, 128, 14, 256, 3, {2, 2, 1, 1}},
      {"resnet 256->256 3x3 @7", nr, 256, 7, 256, 3, {1, 1, 1, 1}},
      {"resnet 256->512 3x3 s2 @7", nr, 256, 7, 512, 3, {2, 2, 1, 1}},
      {"resnet 512->512 3x3 @4", nr, 512, 4, 512, 3, {1, 1, 1, 1}},
      // Shapes beside ResNet-18's, for the reach of Note [Winograd convolution].
      {"reach 128->128 3x3 @28", nr, 128, 28, 128, 3, {1, 1, 1, 1}},
      {"reach 128->128 3x3 @16", nr, 128, 16, 128, 3, {1, 1, 1, 1}},
      {"reach 64->64 3x3 @14", nr, 64, 14, 64, 3, {1, 1, 1, 1}},
      {"reach 32->32 3x3 @14", nr, 32, 14, 32, 3, {1, 1, 1, 1}},
  };
  const std::string only = argc > 5 ? argv[5] : "";
  for (const ConvCase& cc : convs) {
    if (std::string(cc.name).find(only) != std::string::npos) bench_conv(cc, cc.c >= 64 ? 5 : 9);
  }
  if (!only.empty()) return 0;

  std::printf("\nother ops\n");
  const int reps = 9;
  {
    const Tensor x = random({nr, 64, 28, 28});
    Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
    Tensor mean = Tensor::empty({64}), var = Tensor::empty({64}), g = random({64}), b = random({64});
    Tensor s1 = Tensor::empty({64}), s2 = Tensor::empty({64});
    row("bn stats [128,64,28,28]", median_ms([&] { ops::batchnorm_stats(x, mean, var); }, reps));
    var.fill_(1.0f);
    row("bn apply", median_ms([&] { ops::batchnorm_apply(x, mean, var, g, b, y); }, reps));
    row("bn backward_reduce", median_ms([&] { ops::batchnorm_backward_reduce(x, x, mean, s1, s2); }, reps));
    row("bn backward_apply", median_ms([&] {
          ops::batchnorm_backward_apply(x, x, mean, var, g, s1, s2, 1e5, dx); }, reps));
    row("relu forward", median_ms([&] { ops::relu_forward(x, y); }, reps));
    row("relu backward", median_ms([&] { ops::relu_backward(y, x, dx); }, reps));
    row("add (residual)", median_ms([&] { ops::add(x, y, dx); }, reps));
    Tensor p = Tensor::empty({nr, 64, 14, 14}), idx = Tensor::empty({nr, 64, 14, 14}, DType::Int32);
    const ops::Pool2dParams mp{3, 3, 2, 2, 1, 1};
    row("maxpool 3x3 s2 p1 fwd", median_ms([&] { ops::maxpool2d_forward(x, p, idx, mp); }, reps));
    row("maxpool bwd", median_ms([&] { ops::maxpool2d_backward(p, idx, dx); }, reps));
    Tensor gp = Tensor::empty({nr, 64, 1, 1});
    row("global avgpool fwd", median_ms([&] { ops::global_avgpool_forward(x, gp); }, reps));
  }
  {
    const Tensor x = random({nl, 6, 28, 28});
    Tensor y = Tensor::empty({nl, 6, 14, 14}), dx = Tensor::empty(x.shape()), s = Tensor::empty(x.shape());
    row("lenet sigmoid fwd [256,6,28,28]", median_ms([&] { ops::sigmoid_forward(x, s); }, reps));
    row("lenet sigmoid bwd", median_ms([&] { ops::sigmoid_backward(s, x, dx); }, reps));
    row("lenet avgpool 2x2 fwd", median_ms([&] { ops::avgpool2d_forward(x, y, {}); }, reps));
    row("lenet avgpool 2x2 bwd", median_ms([&] { ops::avgpool2d_backward(y, dx, {}); }, reps));
  }
  {
    struct Lin { const char* name; int64_t n, in, out; };
    for (const Lin& l : {Lin{"linear 400->120", nl, 400, 120}, Lin{"linear 120->84", nl, 120, 84},
                         Lin{"linear 512->10", nr, 512, 10}}) {
      const Tensor x = random({l.n, l.in}), w = random({l.out, l.in}), b = random({l.out});
      Tensor y = Tensor::empty({l.n, l.out}), dx = Tensor::empty(x.shape());
      Tensor dw = Tensor::empty(w.shape()), db = Tensor::empty({l.out});
      const double fwd = median_ms([&] { ops::linear_forward(x, w, b, y); }, reps);
      const double prim = matmul_primitive_ms(x, w, y, reps);
      const double bwd = median_ms([&] { ops::linear_backward(x, w, y, dx, dw, db, true); }, reps);
      std::printf("%-34s fwd(sgemm) %.3f  fwd(matmul primitive, no bias) %.3f  bwd %.3f ms\n",
                  l.name, fwd, prim, bwd);
    }
    const Tensor logits = random({nl, 10});
    Tensor labels = Tensor::zeros({nl}, DType::Int64), d = Tensor::empty({nl, 10});
    row("cross_entropy [256,10]", median_ms([&] { ops::cross_entropy(logits, labels, d, 1.0f); }, reps));
    Tensor param = random({512, 512, 3, 3}), grad = random(param.shape()), buf = random(param.shape());
    row("sgd_step momentum 2.4M params", median_ms([&] {
          ops::sgd_step(param, grad, buf, 0.01f, 0.9f, 0.0f, 5e-4f, false, false); }, reps));
  }
  return 0;
}
