// The single place where Python tensors become TensorViews. Every binding that takes a tensor
// goes through `borrow_tensor`, which names the argument in every error it raises.
#pragma once
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "core/tensor_view.h"

namespace asyncpp::bindings {

// `capsule` is what torch.utils.dlpack.to_dlpack(t) returns. The capsule is borrowed, not
// consumed: the view is valid while the capsule (and so the tensor) is alive, i.e. during the call.
TensorView borrow_tensor(const pybind11::handle& capsule, const char* arg_name);
std::vector<TensorView> borrow_tensors(const pybind11::sequence& capsules, const char* arg_name);

// Argument checks with messages that name the argument and the fix.
void expect_dtype(const TensorView& t, DType want, const std::string& arg_name);
void expect_device(const TensorView& t, DeviceKind want, const std::string& arg_name);
void expect_contiguous(const TensorView& t, const std::string& arg_name);
void expect_same_shape(const TensorView& a, const TensorView& b, const std::string& a_name,
                       const std::string& b_name);

}  // namespace asyncpp::bindings
