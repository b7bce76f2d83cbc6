// The in-process face of the native kernels (linear.cpp, int8_fp8.cpp, int4.cpp, float32.cpp,
// decode.cpp, attention.cpp): CPU kernels for the `fxquant::native_*` ops, registered through
// torch's stable ABI when `fxquant.kernels.cpu` loads the shared library (eager calls,
// torch.compile's Inductor wrapper).
// The schemas and fake kernels live in Python (fxquant/kernels/cpu/__init__.py); AOTInductor
// packages call the C shims directly instead.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

extern "C" {
AOTITorchError aoti_torch_cpu_native_int8_weight_only_linear(AtenTensorHandle, AtenTensorHandle,
                                                             AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float32_grouped_mm(AtenTensorHandle, AtenTensorHandle,
                                                        AtenTensorHandle, int64_t, int64_t,
                                                        AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_weight_only_grouped_mm(AtenTensorHandle,
                                                                 AtenTensorHandle,
                                                                 AtenTensorHandle,
                                                                 AtenTensorHandle, int64_t,
                                                                 AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_weight_only_grouped_mm(AtenTensorHandle,
                                                                   AtenTensorHandle,
                                                                   AtenTensorHandle,
                                                                   AtenTensorHandle, int64_t,
                                                                   AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_dynamic_grouped_mm(AtenTensorHandle, AtenTensorHandle,
                                                            AtenTensorHandle, AtenTensorHandle,
                                                            AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_dynamic_grouped_mm(AtenTensorHandle, AtenTensorHandle,
                                                              AtenTensorHandle, AtenTensorHandle,
                                                              double, int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_block_grouped_mm(AtenTensorHandle, AtenTensorHandle,
                                                            AtenTensorHandle, AtenTensorHandle,
                                                            int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int4_grouped_mm(AtenTensorHandle, AtenTensorHandle,
                                                    AtenTensorHandle, AtenTensorHandle,
                                                    AtenTensorHandle, int64_t, int64_t, int64_t,
                                                    AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_weight_only_linear(AtenTensorHandle, AtenTensorHandle,
                                                               AtenTensorHandle,
                                                               AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_bf16dot_linear(AtenTensorHandle, AtenTensorHandle,
                                                         AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_bf16dot_linear(AtenTensorHandle, AtenTensorHandle,
                                                           AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_dynamic_linear(AtenTensorHandle, AtenTensorHandle,
                                                          AtenTensorHandle, double,
                                                          AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_dynamic_bf16dot_linear(AtenTensorHandle,
                                                                  AtenTensorHandle,
                                                                  AtenTensorHandle, double,
                                                                  AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_block_linear(AtenTensorHandle, AtenTensorHandle,
                                                       AtenTensorHandle, int64_t,
                                                       AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_block_scaled_linear(AtenTensorHandle, AtenTensorHandle,
                                                              AtenTensorHandle, AtenTensorHandle,
                                                              int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_scaled_linear(AtenTensorHandle, AtenTensorHandle,
                                                        AtenTensorHandle, AtenTensorHandle,
                                                        AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_dynamic_linear(AtenTensorHandle, AtenTensorHandle,
                                                         AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_scaled_vnni_linear(AtenTensorHandle, AtenTensorHandle,
                                                             AtenTensorHandle, AtenTensorHandle,
                                                             AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_dynamic_vnni_linear(AtenTensorHandle, AtenTensorHandle,
                                                              AtenTensorHandle, AtenTensorHandle,
                                                              AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int4_weight_only_linear(AtenTensorHandle, AtenTensorHandle,
                                                             AtenTensorHandle, AtenTensorHandle,
                                                             int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int4_bf16dot_linear(AtenTensorHandle, AtenTensorHandle,
                                                         AtenTensorHandle, AtenTensorHandle,
                                                         int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_int4_linear(AtenTensorHandle, AtenTensorHandle,
                                                      AtenTensorHandle, AtenTensorHandle,
                                                      AtenTensorHandle, int64_t,
                                                      AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int8_dynamic_int4_linear(AtenTensorHandle, AtenTensorHandle,
                                                              AtenTensorHandle, AtenTensorHandle,
                                                              int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float32_linear(AtenTensorHandle, AtenTensorHandle,
                                                    AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_bfloat16_linear(AtenTensorHandle, AtenTensorHandle,
                                                     AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float16_linear(AtenTensorHandle, AtenTensorHandle,
                                                    AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_float8_to_bfloat16(AtenTensorHandle, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_int4_to_bfloat16(AtenTensorHandle, AtenTensorHandle,
                                                      AtenTensorHandle, int64_t,
                                                      AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_native_gqa_attention(AtenTensorHandle, AtenTensorHandle,
                                                   AtenTensorHandle, AtenTensorHandle, double,
                                                   AtenTensorHandle*);
}

namespace {

using torch::stable::Tensor;

Tensor checked(AOTITorchError err, AtenTensorHandle out, const char* op) {
  // The shims return an error only for inputs outside their contract (dtype, layout, shape);
  // the Python wrappers make them contiguous with the right dtypes, so this is a bug report.
  STD_TORCH_CHECK(err == AOTI_TORCH_SUCCESS, "fxquant::", op,
                  ": inputs outside the kernel's contract (dtype, contiguity or shape)");
  return Tensor(out);
}

Tensor int8_weight_only(Tensor x, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_weight_only_linear(x.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_int8_weight_only_linear");
}

Tensor float32_grouped(Tensor x, Tensor w, Tensor offs, int64_t kn, int64_t skip_zero_rows) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float32_grouped_mm(x.get(), w.get(), offs.get(), kn,
                                                      skip_zero_rows, &out);
  return checked(err, out, "native_float32_grouped_mm");
}

Tensor int8_weight_only_grouped(Tensor x, Tensor w, Tensor scale, Tensor offs, int64_t bf16_x) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_weight_only_grouped_mm(x.get(), w.get(), scale.get(),
                                                               offs.get(), bf16_x, &out);
  return checked(err, out, "native_int8_weight_only_grouped_mm");
}

Tensor float8_weight_only_grouped(Tensor x, Tensor w, Tensor scale, Tensor offs, int64_t bf16_x) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_weight_only_grouped_mm(x.get(), w.get(), scale.get(),
                                                                 offs.get(), bf16_x, &out);
  return checked(err, out, "native_float8_weight_only_grouped_mm");
}

Tensor int8_dynamic_grouped(Tensor x, Tensor w, Tensor scale, Tensor offs) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_dynamic_grouped_mm(x.get(), w.get(), scale.get(),
                                                           offs.get(), &out);
  return checked(err, out, "native_int8_dynamic_grouped_mm");
}

Tensor float8_dynamic_grouped(Tensor x, Tensor w, Tensor scale, Tensor offs, double scale_ub,
                              int64_t bf16_x) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_dynamic_grouped_mm(x.get(), w.get(), scale.get(),
                                                             offs.get(), scale_ub, bf16_x, &out);
  return checked(err, out, "native_float8_dynamic_grouped_mm");
}

Tensor float8_block_grouped(Tensor x, Tensor w, Tensor scale, Tensor offs, int64_t block_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_block_grouped_mm(x.get(), w.get(), scale.get(),
                                                           offs.get(), block_size, &out);
  return checked(err, out, "native_float8_block_grouped_mm");
}

Tensor int4_grouped(Tensor x, Tensor w, Tensor scale, Tensor offset, Tensor offs,
                    int64_t group_size, int64_t bf16_from, int64_t int8_from) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int4_grouped_mm(x.get(), w.get(), scale.get(), offset.get(),
                                                   offs.get(), group_size, bf16_from, int8_from,
                                                   &out);
  return checked(err, out, "native_int4_grouped_mm");
}

Tensor float8_weight_only(Tensor x, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_weight_only_linear(x.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_float8_weight_only_linear");
}

Tensor int8_bf16dot(Tensor x, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_bf16dot_linear(x.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_int8_bf16dot_linear");
}

Tensor float8_bf16dot(Tensor x, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_bf16dot_linear(x.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_float8_bf16dot_linear");
}

Tensor float8_dynamic(Tensor x, Tensor w, Tensor scale, double scale_ub) {
  AtenTensorHandle out = nullptr;
  auto err =
      aoti_torch_cpu_native_float8_dynamic_linear(x.get(), w.get(), scale.get(), scale_ub, &out);
  return checked(err, out, "native_float8_dynamic_linear");
}

Tensor float8_block(Tensor x, Tensor w, Tensor scale, int64_t block_size) {
  AtenTensorHandle out = nullptr;
  auto err =
      aoti_torch_cpu_native_float8_block_linear(x.get(), w.get(), scale.get(), block_size, &out);
  return checked(err, out, "native_float8_block_linear");
}

Tensor float8_block_scaled(Tensor xq, Tensor xs, Tensor w, Tensor scale, int64_t block_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_block_scaled_linear(xq.get(), xs.get(), w.get(),
                                                              scale.get(), block_size, &out);
  return checked(err, out, "native_float8_block_scaled_linear");
}

Tensor float8_dynamic_bf16dot(Tensor x, Tensor w, Tensor scale, double scale_ub) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_dynamic_bf16dot_linear(x.get(), w.get(), scale.get(),
                                                                 scale_ub, &out);
  return checked(err, out, "native_float8_dynamic_bf16dot_linear");
}

Tensor int8_scaled(Tensor xq, Tensor xs, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err =
      aoti_torch_cpu_native_int8_scaled_linear(xq.get(), xs.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_int8_scaled_linear");
}

Tensor int8_dynamic(Tensor x, Tensor w, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_dynamic_linear(x.get(), w.get(), scale.get(), &out);
  return checked(err, out, "native_int8_dynamic_linear");
}

Tensor int8_scaled_vnni(Tensor xq, Tensor xs, Tensor w, Tensor comp, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_scaled_vnni_linear(xq.get(), xs.get(), w.get(), comp.get(),
                                                           scale.get(), &out);
  return checked(err, out, "native_int8_scaled_vnni_linear");
}

Tensor int8_dynamic_vnni(Tensor x, Tensor w, Tensor comp, Tensor scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_dynamic_vnni_linear(x.get(), w.get(), comp.get(),
                                                            scale.get(), &out);
  return checked(err, out, "native_int8_dynamic_vnni_linear");
}

Tensor int4_weight_only(Tensor x, Tensor w, Tensor scale, Tensor offset, int64_t group_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int4_weight_only_linear(x.get(), w.get(), scale.get(),
                                                           offset.get(), group_size, &out);
  return checked(err, out, "native_int4_weight_only_linear");
}

Tensor int4_bf16dot(Tensor x, Tensor w, Tensor scale, Tensor offset, int64_t group_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int4_bf16dot_linear(x.get(), w.get(), scale.get(),
                                                       offset.get(), group_size, &out);
  return checked(err, out, "native_int4_bf16dot_linear");
}

Tensor int8_int4(Tensor xq, Tensor xs, Tensor w, Tensor scale, Tensor offset,
                 int64_t group_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_int4_linear(xq.get(), xs.get(), w.get(), scale.get(),
                                                    offset.get(), group_size, &out);
  return checked(err, out, "native_int8_int4_linear");
}

Tensor int8_dynamic_int4(Tensor x, Tensor w, Tensor scale, Tensor offset, int64_t group_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int8_dynamic_int4_linear(x.get(), w.get(), scale.get(),
                                                            offset.get(), group_size, &out);
  return checked(err, out, "native_int8_dynamic_int4_linear");
}

Tensor float8_to_bfloat16(Tensor w) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float8_to_bfloat16(w.get(), &out);
  return checked(err, out, "native_float8_to_bfloat16");
}

Tensor int4_to_bfloat16(Tensor w, Tensor scale, Tensor offset, int64_t group_size) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_int4_to_bfloat16(w.get(), scale.get(), offset.get(),
                                                    group_size, &out);
  return checked(err, out, "native_int4_to_bfloat16");
}

Tensor float32_linear(Tensor x, Tensor w) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float32_linear(x.get(), w.get(), &out);
  return checked(err, out, "native_float32_linear");
}

Tensor bfloat16_linear(Tensor x, Tensor w) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_bfloat16_linear(x.get(), w.get(), &out);
  return checked(err, out, "native_bfloat16_linear");
}

Tensor float16_linear(Tensor x, Tensor w) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_float16_linear(x.get(), w.get(), &out);
  return checked(err, out, "native_float16_linear");
}

Tensor gqa_attention(Tensor q, Tensor key, Tensor value, Tensor mask, double scale) {
  AtenTensorHandle out = nullptr;
  auto err = aoti_torch_cpu_native_gqa_attention(q.get(), key.get(), value.get(), mask.get(),
                                                 scale, &out);
  return checked(err, out, "native_gqa_attention");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fxquant, CPU, m) {
  m.impl("native_int8_weight_only_linear", TORCH_BOX(&int8_weight_only));
  m.impl("native_int8_weight_only_grouped_mm", TORCH_BOX(&int8_weight_only_grouped));
  m.impl("native_float32_grouped_mm", TORCH_BOX(&float32_grouped));
  m.impl("native_int4_grouped_mm", TORCH_BOX(&int4_grouped));
  m.impl("native_float8_weight_only_grouped_mm", TORCH_BOX(&float8_weight_only_grouped));
  m.impl("native_int8_dynamic_grouped_mm", TORCH_BOX(&int8_dynamic_grouped));
  m.impl("native_float8_dynamic_grouped_mm", TORCH_BOX(&float8_dynamic_grouped));
  m.impl("native_float8_block_grouped_mm", TORCH_BOX(&float8_block_grouped));
  m.impl("native_float8_weight_only_linear", TORCH_BOX(&float8_weight_only));
  m.impl("native_int8_bf16dot_linear", TORCH_BOX(&int8_bf16dot));
  m.impl("native_float8_bf16dot_linear", TORCH_BOX(&float8_bf16dot));
  m.impl("native_float8_dynamic_linear", TORCH_BOX(&float8_dynamic));
  m.impl("native_float8_dynamic_bf16dot_linear", TORCH_BOX(&float8_dynamic_bf16dot));
  m.impl("native_float8_block_linear", TORCH_BOX(&float8_block));
  m.impl("native_float8_block_scaled_linear", TORCH_BOX(&float8_block_scaled));
  m.impl("native_int8_scaled_linear", TORCH_BOX(&int8_scaled));
  m.impl("native_int8_dynamic_linear", TORCH_BOX(&int8_dynamic));
  m.impl("native_int8_scaled_vnni_linear", TORCH_BOX(&int8_scaled_vnni));
  m.impl("native_int8_dynamic_vnni_linear", TORCH_BOX(&int8_dynamic_vnni));
  m.impl("native_int4_weight_only_linear", TORCH_BOX(&int4_weight_only));
  m.impl("native_int4_bf16dot_linear", TORCH_BOX(&int4_bf16dot));
  m.impl("native_int8_int4_linear", TORCH_BOX(&int8_int4));
  m.impl("native_int8_dynamic_int4_linear", TORCH_BOX(&int8_dynamic_int4));
  m.impl("native_float32_linear", TORCH_BOX(&float32_linear));
  m.impl("native_bfloat16_linear", TORCH_BOX(&bfloat16_linear));
  m.impl("native_float16_linear", TORCH_BOX(&float16_linear));
  m.impl("native_float8_to_bfloat16", TORCH_BOX(&float8_to_bfloat16));
  m.impl("native_int4_to_bfloat16", TORCH_BOX(&int4_to_bfloat16));
  m.impl("native_gqa_attention", TORCH_BOX(&gqa_attention));
}
