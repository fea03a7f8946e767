#include "worker/model/model_def.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/fingerprint.h"

namespace psflow::worker {
namespace {

// Largest variable we accept: its element count must fit an int32 so that
// every backend can index it with plain ints.
constexpr int64_t kMaxVariableElements = std::numeric_limits<int32_t>::max();

std::string ShapeString(Shape3 s) { return absl::StrCat("[", s.h, ",", s.w, ",", s.c, "]"); }

// One layer token of the spec, with its 1-based position for messages.
struct Token {
  int index = 0;
  std::string text;
  int line = 0;                       // in the spec's text, from 1
  const std::string* file = nullptr;  // the spec file's path, if it came from one
};

// The token as the message shows it: bytes that are not printable ASCII
// (a byte-order mark, a NUL, a binary file) escaped, so that they show.
std::string Quoted(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (absl::ascii_isprint(c)) {
      out += c;
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
  }
  return out + "\"";
}

absl::Status TokenError(const Token& token, absl::string_view what) {
  const std::string where = token.file == nullptr ? "model spec"
                                                  : absl::StrCat("model spec file \"", *token.file,
                                                                 "\" line ", token.line, ",");
  return absl::InvalidArgumentError(
      absl::StrCat(where, " token ", token.index, " ", Quoted(token.text), ": ", what));
}

// Splits a spec into layer tokens. Layers are separated by ',' or newlines;
// '#' starts a comment that runs to the end of the line; whitespace around
// tokens and their ':'-separated parts is ignored, as are empty tokens.
std::vector<Token> Tokenize(const std::string& spec, const std::string* file) {
  std::vector<Token> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(spec, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    for (absl::string_view piece : absl::StrSplit(line, ',')) {
      std::vector<std::string> parts;
      for (absl::string_view part : absl::StrSplit(piece, ':')) {
        parts.emplace_back(absl::StripAsciiWhitespace(part));
      }
      std::string text = absl::StrJoin(parts, ":");
      if (text.empty()) continue;
      tokens.push_back({static_cast<int>(tokens.size()) + 1, std::move(text), line_number, file});
    }
  }
  return tokens;
}

// Window sizes and strides beyond this are no image's (and would overflow
// the shape arithmetic of the backends).
constexpr int kMaxWindow = 1 << 15;

// Parses `text` as an integer in [1, max], else names `what` in the error.
absl::StatusOr<int> PositiveInt(const Token& token, absl::string_view what,
                                absl::string_view text, int max = INT32_MAX) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 1) {
    // An integer beyond int64 is still an integer: say how large it may be.
    const bool digits = !text.empty() && absl::c_all_of(text, absl::ascii_isdigit) &&
                        text.find_first_not_of('0') != absl::string_view::npos;
    if (digits) {
      return TokenError(token, absl::StrCat(what, " must be at most ", max, ", got ", text));
    }
    return TokenError(token, absl::StrCat(what, " must be a positive integer, got ", Quoted(text)));
  }
  if (value > max) {
    return TokenError(token, absl::StrCat(what, " must be at most ", max, ", got ", value));
  }
  return static_cast<int>(value);
}

// Parses the options after the required fields of a conv2d or maxpool
// token: "same", "valid", "sSTRIDE" and (when `allow_relu`) "relu", each at
// most once, in any order.
absl::Status ParseOptions(const Token& token, const std::vector<std::string>& parts, size_t first,
                          bool allow_relu, bool allow_padding_and_stride, LayerDef* layer) {
  bool seen_padding = false, seen_stride = false, seen_relu = false;
  const std::string expected = absl::StrCat(
      "expected ", allow_relu ? "\"relu\"" : "", allow_relu && allow_padding_and_stride ? ", " : "",
      allow_padding_and_stride ? "\"same\", \"valid\" or \"sSTRIDE\" (e.g. \"s2\")" : "");
  for (size_t i = first; i < parts.size(); ++i) {
    const std::string& opt = parts[i];
    if (allow_relu && opt == "relu") {
      if (seen_relu) return TokenError(token, "\"relu\" given twice");
      seen_relu = true;
      layer->relu = true;
    } else if (allow_padding_and_stride && (opt == "same" || opt == "valid")) {
      if (seen_padding) return TokenError(token, "padding given twice");
      seen_padding = true;
      layer->same_padding = opt == "same";
    } else if (allow_padding_and_stride && opt.size() > 1 && opt[0] == 's' &&
               (absl::ascii_isdigit(opt[1]) || opt[1] == '-' || opt[1] == '+')) {
      // (Only "s" and a number: "stride=2" was read as the stride "tride=2".)
      if (seen_stride) return TokenError(token, "stride given twice");
      seen_stride = true;
      auto stride = PositiveInt(token, "stride", absl::string_view(opt).substr(1), kMaxWindow);
      if (!stride.ok()) return stride.status();
      layer->stride = *stride;
    } else {
      return TokenError(token, absl::StrCat("unknown option ", Quoted(opt), "; ", expected));
    }
  }
  return absl::OkStatus();
}

// Output size of one spatial dimension of a conv/pool layer, or 0 when the
// window does not fit (valid padding only).
int OutputSize(int in, int kernel, int stride, bool same) {
  if (same) return in / stride + (in % stride != 0 ? 1 : 0);  // ceil, without overflow
  if (in < kernel) return 0;
  return (in - kernel) / stride + 1;
}

int SamePadBefore(int in, int out, int kernel, int stride) {
  const int total = (out - 1) * stride + kernel - in;
  return total > 0 ? total / 2 : 0;
}

// A spec file larger than this is no spec (a million-layer spec takes
// about 13 MB).
constexpr size_t kMaxSpecFileBytes = 64 << 20;

absl::StatusOr<std::string> ResolveSpec(const std::string& spec) {
  if (spec == "seed") return std::string(kSeedModelSpec);
  if (spec == "two_conv") return std::string(kTwoConvModelSpec);
  if (!spec.empty() && spec[0] == '@') {
    const std::string path = spec.substr(1);
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      // It opens, and reads as a spec without layers.
      return absl::InvalidArgumentError(
          absl::StrCat("model spec file \"", path,
                       "\" is a directory; expected a file holding a "
                       "spec such as conv2d:32:3:relu,flatten,dense:10"));
    }
    // A fifo or a device would block the read, or never end it.
    if (std::filesystem::exists(path, error) && !std::filesystem::is_regular_file(path, error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec file \"", path,
                       "\" is not a regular file; expected a file holding a "
                       "spec such as conv2d:32:3:relu,flatten,dense:10"));
    }
    errno = 0;
    std::ifstream file(path);
    if (!file) {
      const int error_number = errno;
      const std::string reason =
          error_number != 0 ? absl::StrCat(": ", std::strerror(error_number)) : "";
      const std::string message =
          absl::StrCat("model spec file \"", path, "\" cannot be read", reason);
      return error_number == ENOENT ? absl::NotFoundError(message)
                                    : absl::FailedPreconditionError(message);
    }
    // Read up to one byte past the limit: a file that grows while it is
    // read is held to it too.
    std::string text;
    char buffer[1 << 16];
    while (text.size() <= kMaxSpecFileBytes && file.read(buffer, sizeof buffer).gcount() > 0) {
      text.append(buffer, static_cast<size_t>(file.gcount()));
    }
    if (text.size() > kMaxSpecFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat("model spec file \"", path,
                                                     "\" is larger than ", kMaxSpecFileBytes,
                                                     " bytes; expected a model spec"));
    }
    if (file.bad()) {  // a read error, not the end: the text is cut short
      return absl::DataLossError(absl::StrCat("model spec file \"", path,
                                              "\" could not be read to its end after ", text.size(),
                                              " bytes"));
    }
    return text;
  }
  return spec;
}

// Parses one token into `layer` (kind and hyper-parameters only).
absl::Status ParseLayer(const Token& token, LayerDef* layer) {
  const std::vector<std::string> parts = absl::StrSplit(token.text, ':');
  const std::string& kind = parts[0];
  if (kind == "conv2d") {
    layer->kind = LayerKind::kConv2D;
    if (parts.size() < 3) {
      return TokenError(token, "expected conv2d:FILTERS:KERNEL[:relu][:same|:valid][:sSTRIDE]");
    }
    auto filters = PositiveInt(token, "filters", parts[1]);
    if (!filters.ok()) return filters.status();
    auto kernel = PositiveInt(token, "kernel size", parts[2], kMaxWindow);
    if (!kernel.ok()) return kernel.status();
    layer->units = *filters;
    layer->kernel = *kernel;
    return ParseOptions(token, parts, 3, /*allow_relu=*/true, /*allow_padding_and_stride=*/true,
                        layer);
  }
  if (kind == "maxpool" || kind == "max_pooling2d") {
    layer->kind = LayerKind::kMaxPool2D;
    if (parts.size() < 2) {
      return TokenError(token, "expected maxpool:POOL[:sSTRIDE][:same|:valid]");
    }
    auto pool = PositiveInt(token, "pool size", parts[1], kMaxWindow);
    if (!pool.ok()) return pool.status();
    layer->kernel = *pool;
    layer->stride = *pool;
    return ParseOptions(token, parts, 2, /*allow_relu=*/false, /*allow_padding_and_stride=*/true,
                        layer);
  }
  if (kind == "flatten") {
    layer->kind = LayerKind::kFlatten;
    if (parts.size() > 1) return TokenError(token, "flatten takes no options");
    return absl::OkStatus();
  }
  if (kind == "dense") {
    layer->kind = LayerKind::kDense;
    if (parts.size() < 2) return TokenError(token, "expected dense:UNITS[:relu]");
    auto units = PositiveInt(token, "units", parts[1]);
    if (!units.ok()) return units.status();
    layer->units = *units;
    return ParseOptions(token, parts, 2, /*allow_relu=*/true, /*allow_padding_and_stride=*/false,
                        layer);
  }
  return TokenError(token, absl::StrCat("unknown layer ", Quoted(kind),
                                        "; expected conv2d, maxpool, flatten or dense (or, as the "
                                        "whole --model, a built-in model, seed or two_conv, or "
                                        "@FILE)"));
}

// Fills layer->output from layer->input; errors name the token and shapes.
absl::Status InferShape(const Token& token, LayerDef* layer) {
  const Shape3 in = layer->input;
  switch (layer->kind) {
    case LayerKind::kConv2D:
    case LayerKind::kMaxPool2D: {
      const int oh = OutputSize(in.h, layer->kernel, layer->stride, layer->same_padding);
      const int ow = OutputSize(in.w, layer->kernel, layer->stride, layer->same_padding);
      if (oh <= 0 || ow <= 0) {
        return TokenError(token, absl::StrCat(layer->name, ": a ", layer->kernel, "x",
                                              layer->kernel, " window with stride ", layer->stride,
                                              " and valid padding does not fit the input ",
                                              ShapeString(in), " (output size <= 0)"));
      }
      layer->output = {oh, ow, layer->kind == LayerKind::kConv2D ? layer->units : in.c};
      return absl::OkStatus();
    }
    case LayerKind::kFlatten:
      if (in.size() > kMaxVariableElements) {
        return TokenError(token, absl::StrCat("input ", ShapeString(in), " is too large"));
      }
      layer->output = {1, 1, static_cast<int>(in.size())};
      return absl::OkStatus();
    case LayerKind::kDense:
      if (in.h != 1 || in.w != 1) {
        return TokenError(token, absl::StrCat("dense needs a flat input; add flatten before token ",
                                              token.index, " (input is ", ShapeString(in), ")"));
      }
      layer->output = {1, 1, layer->units};
      return absl::OkStatus();
  }
  return absl::InternalError("unknown layer kind");
}

}  // namespace

absl::StatusOr<ModelDef> ParseModel(const std::string& spec, Shape3 input) {
  if (input.h < 1 || input.w < 1 || input.c < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model input shape must be positive, got ", ShapeString(input)));
  }
  auto text = ResolveSpec(spec);
  if (!text.ok()) return text.status();
  const std::string file = !spec.empty() && spec[0] == '@' ? spec.substr(1) : "";
  const std::vector<Token> tokens = Tokenize(*text, file.empty() ? nullptr : &file);
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model spec \"", spec, "\" has no layers"));
  }

  ModelDef model;
  model.input = input;
  int conv_count = 0, pool_count = 0, flatten_count = 0, dense_count = 0;
  Shape3 current = input;
  std::vector<std::string> texts;
  for (const Token& token : tokens) {
    LayerDef layer;
    if (absl::Status s = ParseLayer(token, &layer); !s.ok()) return s;
    auto numbered = [](const char* base, int* count) {
      const int n = (*count)++;
      return n == 0 ? std::string(base) : absl::StrCat(base, "_", n);
    };
    switch (layer.kind) {
      case LayerKind::kConv2D:
        layer.name = numbered("conv2d", &conv_count);
        break;
      case LayerKind::kMaxPool2D:
        layer.name = numbered("max_pooling2d", &pool_count);
        break;
      case LayerKind::kFlatten:
        layer.name = numbered("flatten", &flatten_count);
        break;
      case LayerKind::kDense:
        layer.name = numbered("dense", &dense_count);
        break;
    }
    // A window over a flat input is a layer out of order, not a window too
    // large: say so (it said "a 3x3 window ... does not fit the input
    // [1,1,128]").
    const bool windowed = layer.kind == LayerKind::kConv2D || layer.kind == LayerKind::kMaxPool2D;
    if (windowed && !model.layers.empty() &&
        (model.layers.back().kind == LayerKind::kFlatten ||
         model.layers.back().kind == LayerKind::kDense)) {
      return TokenError(
          token,
          absl::StrCat(layer.name, " needs an image input, but it comes after ",
                       model.layers.back().name, ", whose output is flat ", ShapeString(current),
                       "; expected conv2d and maxpool layers before flatten"));
    }
    layer.input = current;
    if (absl::Status s = InferShape(token, &layer); !s.ok()) return s;
    current = layer.output;

    if (layer.kind == LayerKind::kConv2D || layer.kind == LayerKind::kDense) {
      VariableSpec kernel{layer.name + "/kernel", {}};
      if (layer.kind == LayerKind::kConv2D) {
        kernel.shape = {layer.kernel, layer.kernel, layer.input.c, layer.units};
      } else {
        kernel.shape = {layer.input.c, layer.units};
      }
      if (kernel.num_elements() > kMaxVariableElements) {
        return TokenError(
            token, absl::StrCat(kernel.name, " would have ", kernel.num_elements(),
                                " elements; at most ", kMaxVariableElements, " are supported"));
      }
      layer.kernel_var = static_cast<int>(model.variables.size());
      model.variables.push_back(std::move(kernel));
      layer.bias_var = static_cast<int>(model.variables.size());
      model.variables.push_back({layer.name + "/bias", {layer.units}});
    }
    texts.push_back(token.text);
    model.layers.push_back(std::move(layer));
  }

  const LayerDef& last = model.layers.back();
  if (last.kind != LayerKind::kDense || last.relu) {
    return TokenError(tokens.back(),
                      "the last layer must be dense without relu (its outputs are the logits)");
  }
  model.num_classes = last.units;
  model.spec = absl::StrJoin(texts, ",");
  return model;
}

uint64_t ModelFingerprint(const ModelDef& model, std::string_view dataset) {
  Fnv1a64 h;
  h.AddString("psflow model 1");  // the version of this encoding
  h.AddString(dataset);
  for (int v : {model.input.h, model.input.w, model.input.c, model.num_classes}) h.AddInt(v);
  h.AddInt(static_cast<int64_t>(model.layers.size()));
  for (const LayerDef& l : model.layers) {
    for (int64_t v : {static_cast<int64_t>(l.kind), int64_t{l.units}, int64_t{l.kernel},
                      int64_t{l.stride}, int64_t{l.same_padding}, int64_t{l.relu}}) {
      h.AddInt(v);
    }
  }
  return h.value();
}

int64_t ActivationsPerExample(const ModelDef& model) {
  // Each size is below 2^62 (sides of at most 2^15, channels of at most
  // 2^31), but their sum is not: it saturates, so that no memory check is
  // passed by a sum that wrapped around.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t n = model.input.size();
  for (const LayerDef& layer : model.layers) {
    if (layer.kind == LayerKind::kFlatten) continue;
    n = layer.output.size() > kMax - n ? kMax : n + layer.output.size();
  }
  return n;
}

std::vector<std::vector<float>> InitializeVariables(const ModelDef& model, uint64_t seed) {
  // One mt19937_64 stream over the variables in order, mapped to [0, 1) by
  // taking its top 53 bits: the same numbers on every platform (the
  // std:: distributions are implementation-defined).
  std::mt19937_64 gen(seed);
  std::vector<std::vector<float>> values(model.variables.size());
  for (size_t i = 0; i < model.variables.size(); ++i) {
    values[i].assign(model.variables[i].num_elements(), 0.0f);
  }
  for (const LayerDef& layer : model.layers) {
    if (layer.kernel_var < 0) continue;
    double fan_in, fan_out;
    if (layer.kind == LayerKind::kConv2D) {
      const double area = double{1} * layer.kernel * layer.kernel;
      fan_in = area * layer.input.c;
      fan_out = area * layer.units;
    } else {
      fan_in = layer.input.c;
      fan_out = layer.units;
    }
    const double limit = std::sqrt(6.0 / (fan_in + fan_out));
    for (float& v : values[layer.kernel_var]) {
      const double u = static_cast<double>(gen() >> 11) * 0x1.0p-53;  // [0, 1)
      v = static_cast<float>(limit * (2.0 * u - 1.0));
    }
    // Biases stay zero (Keras "zeros").
  }
  return values;
}

int PadTop(const LayerDef& layer) {
  if (!layer.same_padding ||
      (layer.kind != LayerKind::kConv2D && layer.kind != LayerKind::kMaxPool2D)) {
    return 0;
  }
  return SamePadBefore(layer.input.h, layer.output.h, layer.kernel, layer.stride);
}

int PadLeft(const LayerDef& layer) {
  if (!layer.same_padding ||
      (layer.kind != LayerKind::kConv2D && layer.kind != LayerKind::kMaxPool2D)) {
    return 0;
  }
  return SamePadBefore(layer.input.w, layer.output.w, layer.kernel, layer.stride);
}

}  // namespace psflow::worker
