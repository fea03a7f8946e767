// ModelDef: a Sequential model as a list of layers, parsed from a short spec
// string such as "conv2d:32:3:relu,flatten,dense:128:relu,dense:10".
// Layout follows Keras (channels_last): images are NHWC, a Conv2D kernel is
// [kh, kw, in_channels, filters], a Dense kernel is [in, units]; every layer
// with weights owns "<layer>/kernel" and "<layer>/bias" (layer names as Keras
// numbers them: conv2d, conv2d_1, dense, dense_1, ...). The last layer's
// outputs are logits trained with softmax cross-entropy on integer labels.
#ifndef PSFLOW_WORKER_MODEL_MODEL_DEF_H_
#define PSFLOW_WORKER_MODEL_MODEL_DEF_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/variable_spec.h"

namespace psflow::worker {

enum class LayerKind { kConv2D, kMaxPool2D, kFlatten, kDense };

// Height, width, channels of one example's activations (Dense/Flatten
// outputs are {1, 1, units}).
struct Shape3 {
  int h = 0, w = 0, c = 0;
  int64_t size() const { return int64_t{h} * w * c; }
  bool operator==(const Shape3&) const = default;
};

struct LayerDef {
  LayerKind kind = LayerKind::kDense;
  std::string name;           // "conv2d", "dense_1", "max_pooling2d", ...
  int units = 0;              // Conv2D filters or Dense units
  int kernel = 0;             // Conv2D kernel size or MaxPool2D pool size
  int stride = 1;             // Conv2D / MaxPool2D stride (pool: defaults to pool size)
  bool same_padding = false;  // Conv2D / MaxPool2D: "same" instead of "valid"
  bool relu = false;          // Conv2D / Dense: ReLU after the bias
  Shape3 input;               // filled by ParseModel
  Shape3 output;              // filled by ParseModel
  int kernel_var = -1;        // index into ModelDef::variables, or -1
  int bias_var = -1;
};

struct ModelDef {
  std::string spec;       // the spec it was parsed from
  Shape3 input;           // one example, e.g. {28, 28, 1}
  int num_classes = 0;    // outputs of the last layer
  std::vector<LayerDef> layers;
  std::vector<VariableSpec> variables;  // in layer order: kernel, bias, ...
};

// Built-in specs.
inline constexpr char kSeedModelSpec[] = "conv2d:32:3:relu,flatten,dense:128:relu,dense:10";
// Two convolutions with "same" padding, each followed by 2x2 max pooling, as
// the Keras tutorials write it.
inline constexpr char kTwoConvModelSpec[] =
    "conv2d:32:3:relu:same,maxpool:2,conv2d:64:3:relu:same,maxpool:2,flatten,dense:128:relu,"
    "dense:10";

// Parses `spec` (a spec string, the name of a built-in: "seed" or "two_conv",
// or "@path" to read the spec from a file) for inputs of shape `input`.
// Errors name the offending token and what was expected. The last layer must
// be a Dense layer without relu; its units are num_classes.
absl::StatusOr<ModelDef> ParseModel(const std::string& spec, Shape3 input);

// A fingerprint of what the model computes, for the processes of one job
// to check that they train the same network on the same data: the input
// shape, every layer's kind and settings (units, kernel, stride, padding,
// activation) and the data set's name. Two specs that spell the same
// layers differently (a built-in's name, a file) give the same one.
uint64_t ModelFingerprint(const ModelDef& model, std::string_view dataset);

// Values one example's forward pass produces: its input and every layer's
// output but a flatten's (its input's, reshaped). A backend holds at least
// these and their gradients per example of a batch. Saturates at INT64_MAX.
int64_t ActivationsPerExample(const ModelDef& model);

// Keras initializers: Glorot-uniform kernels, zero biases, from `seed`.
// Returns one vector per entry of model.variables.
std::vector<std::vector<float>> InitializeVariables(const ModelDef& model, uint64_t seed);

// TF's padding before the first row (PadTop) / column (PadLeft) of a Conv2D
// or MaxPool2D layer: 0 for "valid"; for "same", pad_total / 2 where
// pad_total = max((out - 1) * stride + kernel - in, 0) (the odd extra row or
// column goes after the last one). 0 for Flatten and Dense.
int PadTop(const LayerDef& layer);
int PadLeft(const LayerDef& layer);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_MODEL_MODEL_DEF_H_
