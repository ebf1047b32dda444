// C launcher API of paravt's CUDA packing kernels. No torch and no CUDA headers here: the
// .cu file compiles with plain nvcc (CMake checks it on machines whose torch has no CUDA), and
// the torch binding (csrc/pack_vision_cuda.cpp) calls these functions with raw pointers.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One crop: contiguous (T, H, W, 3) uint8 frames in device memory and its place in the pack.
typedef struct paravt_crop_desc {
  const uint8_t* frames;  // device pointer
  int64_t T, H, W;        // frames and pixel size
  int64_t gh, gw;         // patch grid h = H / patch, w = W / patch
  int64_t patch_offset;   // index of the crop's first patch in the packed output
} paravt_crop_desc;

// pixel_values[g, e] = lut[c, frames[f, row*p+py, col*p+px, c]] for every packed patch g and
// element e = (c, tpi, py, px); frames past T repeat the last one. out: (n_patches, 3*tp*p*p)
// elements of elem_bytes bytes (4: float32, 2: bfloat16/float16; the gather copies the LUT's
// bits, so the output dtype is the LUT's). crops: device array of n_crops descriptors sorted by
// patch_offset. lut: device (3, 256) table. stream: a cudaStream_t (nullptr = default stream).
// Returns 0 or a cudaError_t code (see paravt_cuda_error_string).
int paravt_pack_pixels_cuda(const paravt_crop_desc* crops, int64_t n_crops, const void* lut,
                            void* out, int elem_bytes, int64_t n_patches, int64_t patch_size,
                            int64_t temporal_patch_size, int64_t merge_size, void* stream);

// position_ids (n_patches, 2) int64 and, when side > 0, interp_indices / interp_weights
// (n_patches, 4) (bilinear, align_corners=True taps into a side x side table).
int paravt_vision_meta_cuda(const paravt_crop_desc* crops, int64_t n_crops, int64_t n_patches,
                            int64_t merge_size, int64_t side, int64_t* position_ids,
                            int64_t* interp_indices, float* interp_weights, void* stream);

const char* paravt_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif
