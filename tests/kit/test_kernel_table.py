#!/usr/bin/env python3
"""scripts/kernel_table.py on hand-written ncu raw-page exports (fixtures/ncu-raw-*.csv).

  test_kernel_table.py [SCRIPTS_DIR]      (default: ../../scripts beside this file)

The fixtures are what `ncu --import REP --csv --page raw --print-kernel-base demangled
--print-units base` writes for two steps: a header row, a units row, one row per launch
with ncu's demangled names (mtrain's kernels of tensor/cuda/*.cu, cuDNN's and cuBLAS's,
PyTorch's at::native kernels, NCCL's) and round times, so every kind's milliseconds per
step are known by hand. The test fails when a kernel lands in the wrong kind: mtrain's
batch norm in "other" (the profile stage's first version), a cuBLAS product among the
convolutions, a PyTorch copy among the elementwise kernels.
"""
import io
import pathlib
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = pathlib.Path(__file__).resolve().parent
SCRIPTS = pathlib.Path(sys.argv.pop(1)) if len(sys.argv) > 1 else HERE.parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import kernel_table  # noqa: E402

MTRAIN_CSV = HERE / "fixtures" / "ncu-raw-mtrain.csv"
PYTORCH_CSV = HERE / "fixtures" / "ncu-raw-pytorch.csv"
M = "mtrain::cuda_ops::(anonymous namespace)::"

# Milliseconds per step by kind, summed by hand from the fixtures (2 steps).
MTRAIN_KINDS = {"convolution": 2.0, "batch norm": 1.0, "elementwise": 0.5, "collective": 0.15, "pooling": 0.1,
                "optimizer": 0.1, "copies": 0.075, "matmul": 0.05, "loss": 0.04, "other": 0.01}
PYTORCH_KINDS = {"convolution": 1.7, "batch norm": 0.45, "elementwise": 0.35, "collective": 0.14,
                 "reduction": 0.12, "optimizer": 0.08, "matmul": 0.05, "copies": 0.04, "loss": 0.03}


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "kernel_table.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


class Classification(unittest.TestCase):
    def check(self, cases):
        for name, kind in cases:
            with self.subTest(name=name[:80]):
                self.assertEqual(kernel_table.kind_of(name), kind)

    def test_mtrain_batch_norm_kernels_are_batch_norm(self):
        # Templated on functors and taking BnGeometry: their own name decides.
        self.check([
            (f"void {M}channel_partials_kernel<1, unsigned int, {M}SumX>(T3, {M}BnGeometry, long, double *)",
             "batch norm"),
            (f"void {M}channel_finish_kernel<{M}StoreGradientSums>(T1, const double *, long, long)", "batch norm"),
            (f"void {M}apply_kernel(const float *, const float *, const float *, const float *, const float *, "
             f"float *, {M}BnGeometry, bool)", "batch norm"),
            (f"void {M}merge_stats_kernel(const float *, long, long, float *, float *, float *)", "batch norm"),
            (f"void {M}fused_bn_backward_kernel<float>(const float *, float *)", "batch norm"),
            # The names of tensor/cuda/batchnorm*.cu since the fused batch norm: bn_ first.
            (f"void {M}bn_partials_kernel<1, unsigned int, {M}SumX>(T3, {M}BnGeometry, long, double *)",
             "batch norm"),
            (f"void {M}bn_apply_kernel<true>(const float *, const float *, const float *, float *, {M}BnGeometry)",
             "batch norm"),
            (f"void {M}bn_prepare_kernel(const float *, const float *, float *, long)", "batch norm"),
            (f"void {M}bn_merge_stats_kernel(const float *, long, long, float *, float *, float *)", "batch norm"),
            (f"void {M}batchnorm_stats_kernel<256>(const float *, double *)", "batch norm"),
            # The bare names of --print-kernel-base function.
            ("channel_partials_kernel", "batch norm"), ("backward_apply_kernel", "batch norm"),
            ("invstd_kernel", "batch norm"), ("update_running_kernel", "batch norm"),
            ("param_grads_kernel", "batch norm"),
        ])

    def test_mtrain_other_kernels(self):
        self.check([
            (f"void {M}map_kernel<2, {M}AddScaled>(T2, const float *, const float *, float *, long, bool)",
             "elementwise"),
            (f"void {M}map16_kernel<2, __nv_bfloat16, {M}Add>(T3, const T2 *, const T2 *, T2 *, long)",
             "elementwise"),
            (f"void {M}channel_bias_kernel<__half, __half, unsigned int>(const T1 *, const float *, T2 *, T3, T3, T3)",
             "elementwise"),
            (f"void {M}fill_kernel(float *, float, long)", "copies"),
            (f"void {M}widen_kernel<__nv_bfloat16>(const T1 *, float *, long, bool)", "copies"),
            (f"void {M}maxpool_backward_kernel(const float *, const int *, float *, {M}PoolGeometry)", "pooling"),
            (f"void {M}avgpool_forward_kernel(const float *, float *, {M}PoolGeometry, float)", "pooling"),
            (f"void {M}loss_stats_kernel(const float *, const long *, float *)", "loss"),
            (f"void {M}unscale_kernel(float *, long, float, int *)", "optimizer"),
            (f"void {M}sgd_kernel(float *, const float *, float *, long, {M}SgdHyper)", "optimizer"),
        ])

    def test_vendor_kernels(self):
        self.check([
            ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_cudnn",
             "convolution"),
            ("void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false, "
             "(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nhwc2nchw_params_t<T3>, const T1 *, T2 *)",
             "convolution"),
            ("void cudnn::cnn::wgrad2d_grouped_direct_kernel<false, float, float, float>(cudnnTensorStruct)",
             "convolution"),
            ("void fft2d_r2c_32x32<float, false, 0u, false>(float2 *, const float *, int, int)", "convolution"),
            ("cutlass_tensorop_s1688fprop_optimized_tf32_64x64_16x10_nhwc_align4", "convolution"),
            ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4"
             "_execute_kernel_trt", "matmul"),
            ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>(T1::Params)", "matmul"),
            ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, "
             "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<const float>>>(T13, T6, T6)", "matmul"),
            ("void op_generic_tensor_kernel<3, float, float, float, 256, (cudnnGenericOp_t)0, "
             "(cudnnNanPropagation_t)0, 0>(cudnnTensorStruct, float *)", "elementwise"),
            ("void cudnn::bn_bw_1C11_singleread<float, 512, true, 1, 2, 0>(float, float, float, float)",
             "batch norm"),
            ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096UL>)", "collective"),
            ("void cudnn::ops::convertTensor_kernel<__half, __half, float, 0>(float, const __half *, __half *)",
             "copies"),
        ])

    def test_pytorch_kernels(self):
        a = "at::native::"
        self.check([
            (f"void {a}batch_norm_backward_elemt_kernel<float, float, float, int>(int)", "batch norm"),
            (f"void {a}batch_norm_collect_statistics_channels_last_kernel<{a}Var, float, float, 4>(const T2 *)",
             "batch norm"),
            # An elementwise wrapper around a batch-norm lambda is batch norm, around add it is elementwise.
            (f"void {a}elementwise_kernel<128, 4, {a}gpu_kernel_impl_nocast<{a}batch_norm_elementwise("
             f"const at::Tensor &)::[lambda(float) (instance 1)]>(at::TensorIteratorBase &)>(int, T3)",
             "batch norm"),
            (f"void {a}vectorized_elementwise_kernel<4, {a}CUDAFunctor_add<float>, at::detail::Array<char *, 3>>"
             "(int, T2, T3)", "elementwise"),
            (f"void {a}(anonymous namespace)::max_pool_forward_nchw<float, float>(int, const T1 *)", "pooling"),
            (f"void {a}(anonymous namespace)::adaptive_average_pool<float>(const T1 *, T1 *, int, int)",
             "pooling"),
            (f"void {a}(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(T1 *)",
             "loss"),
            (f"void {a}(anonymous namespace)::multi_tensor_apply_kernel<{a}(anonymous namespace)::"
             f"TensorListMetadata<3>, {a}(anonymous namespace)::PointwiseOpScalarFunctor<float, 3, 2, 0>, "
             "std::multiplies<float>, float>(T1, T2, T3, T4)", "optimizer"),
            (f"void {a}reduce_kernel<512, 1, {a}ReduceOp<float, {a}MeanOps<float, float, float, float>, "
             "unsigned int, float, 4, 4>>(T3)", "reduction"),
        ])

    def test_short_names_drop_namespaces_and_parameters(self):
        self.assertEqual(kernel_table.short_name(
            f"void {M}channel_partials_kernel<1, unsigned int, {M}SumX>(T3, {M}BnGeometry, long, double *)"),
            "channel_partials_kernel<1, unsigned int, SumX>")
        self.assertEqual(kernel_table.short_name(f"void {M}map_kernel<1, {M}Relu>(T2, const float *, long, bool)"),
                         "map_kernel<1, Relu>")


class Totals(unittest.TestCase):
    def check_kinds(self, path, expected, launches_per_step):
        s = kernel_table.summarise(kernel_table.read_launches(path), steps=2)
        kinds = {kind: ms for kind, _, ms in s["kinds"]}
        self.assertEqual(set(kinds), set(expected))
        for kind, ms in expected.items():
            self.assertAlmostEqual(kinds[kind], ms, places=9, msg=kind)
        self.assertAlmostEqual(s["ms"], sum(expected.values()), places=9)
        self.assertEqual(s["launches"], launches_per_step)
        # Largest first.
        self.assertEqual([k for k, _, _ in s["kinds"]], sorted(expected, key=lambda k: -expected[k]))
        return s

    def test_mtrain(self):
        s = self.check_kinds(MTRAIN_CSV, MTRAIN_KINDS, 28)
        # Only the unknown kernel is "other": none of mtrain's own.
        self.assertEqual([kernel_table.short_name(k) for k, _, _ in s["kernels"]
                          if kernel_table.kind_of(k) == "other"], ["mystery_kernel"])

    def test_pytorch(self):
        self.check_kinds(PYTORCH_CSV, PYTORCH_KINDS, 20)


class CommandLine(unittest.TestCase):
    def test_two_runs_with_wall_times(self):
        r = run_script("--steps", 2, "--wall", "mtrain=5.0", "--wall", "pytorch=3.7",
                       f"mtrain={MTRAIN_CSV}", f"pytorch={PYTORCH_CSV}")
        self.assertEqual(r.returncode, 0, r.stderr)
        out = r.stdout
        self.assertIn("GPU busy 4.03 ms per step, 80% of the step's 5.00 ms wall time", out)
        self.assertIn("GPU busy 2.96 ms per step, 80% of the step's 3.70 ms wall time", out)
        self.assertIn("| batch norm | 10.0 | 1.000 | 24.8% |", out)   # mtrain: 20 launches in 2 steps
        self.assertIn("| `channel_partials_kernel<1, unsigned int, SumX>` | batch norm | 1.0 | 0.150 | 3.7% |", out)
        last = out.strip().splitlines()[-1]
        self.assertTrue(last.startswith("mtrain 4.03 ms/step (80% of 5.00 ms wall) in 28 launches (convolution 2.00, "
                                        "batch norm 1.00, elementwise 0.50,"), last)
        self.assertIn("; pytorch 2.96 ms/step (80% of 3.70 ms wall) in 20 launches (convolution 1.70, batch norm 0.45,",
                      last)

    def test_the_old_command_line_and_bare_names(self):
        # --steps N NAME=CSV as the first profile stage called it, on --print-kernel-base function names.
        with tempfile.TemporaryDirectory() as tmp:
            bare = pathlib.Path(tmp, "bare.csv")
            bare.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n'
                            '"0","channel_partials_kernel","3000000"\n"1","apply_kernel","1000000"\n'
                            '"2","map_kernel","2000000"\n')
            r = run_script("--steps", 1, f"mtrain={bare}")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("(no wall time given: --wall NAME=MS)", r.stdout)
        self.assertEqual(r.stdout.strip().splitlines()[-1],
                         "mtrain 6.00 ms/step in 3 launches (batch norm 4.00, elementwise 2.00)")

    def test_a_missing_profile_fails(self):
        r = run_script("--steps", 3, "mtrain=/nonexistent/profile.csv")
        self.assertEqual(r.returncode, 1)
        self.assertIn("mtrain: ", r.stdout)

    def test_main_in_process(self):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = kernel_table.main(["--steps", "2", "--top", "3", f"pytorch={PYTORCH_CSV}"])
        self.assertEqual(rc, 0)
        rows = [l for l in buf.getvalue().splitlines() if l.startswith("| `")]
        self.assertEqual(len(rows), 3)
        self.assertTrue(rows[0].startswith("| `sm90_xmma_fprop_implicit_gemm"), rows[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
