// The one bindings file of paravt._C: op schemas (TORCH_LIBRARY) and their CPU / CUDA kernels.
// Importing paravt._C registers torch.ops.paravt.*; the typed Python wrappers live in
// paravt/vision/pack.py.
#include <Python.h>
#include <torch/library.h>

#include <optional>

#include "pack_vision.h"

namespace {

using Affine = std::optional<at::ArrayRef<double>>;

paravt::PackOut pack_vision_cpu_op(const at::TensorList crops, const at::Tensor& lut,
                                   int64_t patch_size, int64_t temporal_patch_size,
                                   int64_t merge_size, int64_t num_grid_per_side,
                                   int64_t window_size, Affine affine) {
  return paravt::pack_vision_cpu(crops.vec(), lut, patch_size, temporal_patch_size, merge_size,
                                 num_grid_per_side, window_size, affine);
}

void pack_pixels_out_cpu_op(const at::TensorList crops, const at::Tensor& lut, int64_t patch_size,
                            int64_t temporal_patch_size, int64_t merge_size, const at::Tensor& out,
                            Affine affine) {
  paravt::pack_pixels_out_cpu(crops.vec(), lut, patch_size, temporal_patch_size, merge_size, out,
                              affine);
}

#ifdef PARAVT_WITH_CUDA
paravt::PackOut pack_vision_cuda_op(const at::TensorList crops, const at::Tensor& lut,
                                    int64_t patch_size, int64_t temporal_patch_size,
                                    int64_t merge_size, int64_t num_grid_per_side,
                                    int64_t window_size, Affine /*affine: the LUT is as fast*/) {
  return paravt::pack_vision_cuda(crops.vec(), lut, patch_size, temporal_patch_size, merge_size,
                                  num_grid_per_side, window_size);
}
#endif

}  // namespace

TORCH_LIBRARY(paravt, m) {
  // crops: (T_i, H_i, W_i, 3) uint8; lut: (3, 256) float32 normalisation table; affine:
  // (mean'[3], std'[3]) of that table's arithmetic, selecting the CPU's vectorised kernel.
  // num_grid_per_side = 0 skips the Qwen3-VL position-embedding interpolation;
  // window_size = 0 skips the Qwen2.5-VL window index.
  m.def(
      "pack_vision(Tensor[] crops, Tensor lut, int patch_size, int temporal_patch_size, "
      "int merge_size, int num_grid_per_side, int window_size, float[]? affine=None) -> "
      "(Tensor pixel_values, "
      "Tensor grid_thw, Tensor cu_seqlens, Tensor position_ids, Tensor interp_indices, "
      "Tensor interp_weights, Tensor window_index, Tensor cu_window_seqlens)");
  // Out variant of the pixel packing (no metadata): writes into a caller-owned buffer.
  m.def(
      "pack_pixels_out(Tensor[] crops, Tensor lut, int patch_size, int temporal_patch_size, "
      "int merge_size, Tensor(a!) out, float[]? affine=None) -> ()");
  // grid_thw: (n, 3) integer CPU tensor; same metadata as pack_vision, without pixels.
  m.def(
      "vision_metadata(Tensor grid_thw, int merge_size, int num_grid_per_side, int window_size, "
      "int patch_size) -> (Tensor cu_seqlens, Tensor position_ids, Tensor interp_indices, "
      "Tensor interp_weights, Tensor window_index, Tensor cu_window_seqlens)");
}

TORCH_LIBRARY_IMPL(paravt, CPU, m) {
  m.impl("pack_vision", &pack_vision_cpu_op);
  m.impl("vision_metadata", &paravt::vision_metadata_cpu);
  m.impl("pack_pixels_out", &pack_pixels_out_cpu_op);
}

#ifdef PARAVT_WITH_CUDA
TORCH_LIBRARY_IMPL(paravt, CUDA, m) { m.impl("pack_vision", &pack_vision_cuda_op); }
#endif

// paravt._C is imported as a Python module only to load the op registrations above.
static PyModuleDef paravt_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                      "paravt native ops (torch.ops.paravt.*)", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&paravt_c_module); }
