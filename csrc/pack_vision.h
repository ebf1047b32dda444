// Torch-side declarations of paravt's vision packing ops (CPU always, CUDA when built with it).
#pragma once

#include <torch/types.h>

#include <optional>
#include <tuple>
#include <vector>

namespace paravt {

// Crop geometry checked once on the host: (T, H, W) per crop and the patch offsets.
struct CropLayout {
  std::vector<int64_t> T, H, W;        // frames, height, width of each crop
  std::vector<int64_t> grid;           // n x 3: (t, h, w) in patches
  std::vector<int64_t> patch_offset;   // n + 1 prefix sums of t*h*w
};

// Validates crops (uint8, (T, H, W, 3), sides multiples of p*m, same device) and computes
// the layout. Throws a c10::Error naming the offending crop and the fix.
CropLayout crop_layout(const std::vector<at::Tensor>& crops, int64_t patch_size,
                       int64_t temporal_patch_size, int64_t merge_size);

void check_lut(const at::Tensor& lut, const at::Device& device);

// (pixel_values (N, 3*tp*p*p) float32, grid_thw (n, 3) int64) on the crops' device.
// affine: (mean'[3], std'[3]) of the LUT's arithmetic selects the vectorised affine kernel
// (bit-identical, float32/bfloat16 outputs); nullopt uses the LUT gather.
std::tuple<at::Tensor, at::Tensor> pack_pixels_cpu(
    const std::vector<at::Tensor>& crops, const at::Tensor& lut, int64_t patch_size,
    int64_t temporal_patch_size, int64_t merge_size,
    const std::optional<at::ArrayRef<double>>& affine = std::nullopt);

// Out variant: packs into a caller-owned contiguous float32 (N, 3*tp*p*p) tensor, e.g. a
// slice of a reused (pinned) staging buffer, so steady-state packing never page-faults.
void pack_pixels_out_cpu(const std::vector<at::Tensor>& crops, const at::Tensor& lut,
                         int64_t patch_size, int64_t temporal_patch_size, int64_t merge_size,
                         const at::Tensor& out,
                         const std::optional<at::ArrayRef<double>>& affine = std::nullopt);

// Metadata from grid_thw: (cu_seqlens int32, position_ids (N,2) int64, interp_indices (N,4)
// int64, interp_weights (N,4) float32, window_index (N/m^2,) int64, cu_window_seqlens int32).
// num_grid_per_side == 0 skips the interpolation (empty (0, 4) tensors); window_size == 0
// skips the window index (empty tensors).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
vision_metadata_cpu(const at::Tensor& grid_thw, int64_t merge_size, int64_t num_grid_per_side,
                    int64_t window_size, int64_t patch_size);

// cu_seqlens (sum_i t_i + 1,) int32 from a flat host grid (n x 3): one segment per temporal
// patch of h*w patches (HF: repeat_interleave(h*w, t).cumsum()).
at::Tensor cu_seqlens_host(const std::vector<int64_t>& grid);

// Window index and cu_window_seqlens on the host (both paths use it: it is Qwen2.5-VL only
// and a sequential scan per crop).
std::tuple<at::Tensor, at::Tensor> window_index_host(const std::vector<int64_t>& grid,
                                                     int64_t merge_size, int64_t window_size,
                                                     int64_t patch_size);

using PackOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor, at::Tensor>;

// Everything at once: (pixel_values, grid_thw, cu_seqlens, position_ids, interp_indices,
// interp_weights, window_index, cu_window_seqlens), all on the crops' device.
PackOut pack_vision_cpu(const std::vector<at::Tensor>& crops, const at::Tensor& lut,
                        int64_t patch_size, int64_t temporal_patch_size, int64_t merge_size,
                        int64_t num_grid_per_side, int64_t window_size,
                        const std::optional<at::ArrayRef<double>>& affine = std::nullopt);

#ifdef PARAVT_WITH_CUDA
PackOut pack_vision_cuda(const std::vector<at::Tensor>& crops, const at::Tensor& lut,
                         int64_t patch_size, int64_t temporal_patch_size, int64_t merge_size,
                         int64_t num_grid_per_side, int64_t window_size);
#endif

}  // namespace paravt
