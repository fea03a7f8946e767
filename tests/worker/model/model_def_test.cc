#include "worker/model/model_def.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr Shape3 kMnist{28, 28, 1};

std::vector<std::string> VariableNames(const ModelDef& m) {
  std::vector<std::string> names;
  for (const auto& v : m.variables) names.push_back(v.name);
  return names;
}

TEST(ParseModelTest, SeedModelHasKerasShapesAndNames) {
  auto m = ParseModel("seed", kMnist);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->spec, kSeedModelSpec);
  EXPECT_EQ(m->num_classes, 10);
  ASSERT_EQ(m->layers.size(), 4u);
  EXPECT_EQ(m->layers[0].name, "conv2d");
  EXPECT_EQ(m->layers[0].kind, LayerKind::kConv2D);
  EXPECT_EQ(m->layers[0].input, (Shape3{28, 28, 1}));
  EXPECT_EQ(m->layers[0].output, (Shape3{26, 26, 32}));
  EXPECT_TRUE(m->layers[0].relu);
  EXPECT_FALSE(m->layers[0].same_padding);
  EXPECT_EQ(m->layers[0].stride, 1);
  EXPECT_EQ(m->layers[1].name, "flatten");
  EXPECT_EQ(m->layers[1].output, (Shape3{1, 1, 26 * 26 * 32}));
  EXPECT_EQ(m->layers[2].name, "dense");
  EXPECT_EQ(m->layers[2].output, (Shape3{1, 1, 128}));
  EXPECT_EQ(m->layers[3].name, "dense_1");
  EXPECT_FALSE(m->layers[3].relu);
  EXPECT_THAT(VariableNames(*m), ElementsAre("conv2d/kernel", "conv2d/bias", "dense/kernel",
                                             "dense/bias", "dense_1/kernel", "dense_1/bias"));
  EXPECT_THAT(m->variables[0].shape, ElementsAre(3, 3, 1, 32));
  EXPECT_THAT(m->variables[1].shape, ElementsAre(32));
  EXPECT_THAT(m->variables[2].shape, ElementsAre(21632, 128));
  EXPECT_THAT(m->variables[4].shape, ElementsAre(128, 10));
  EXPECT_EQ(m->layers[0].kernel_var, 0);
  EXPECT_EQ(m->layers[0].bias_var, 1);
  EXPECT_EQ(m->layers[1].kernel_var, -1);
  EXPECT_EQ(m->layers[3].kernel_var, 4);
  int64_t total = 0;
  for (const auto& v : m->variables) total += v.num_elements();
  EXPECT_EQ(total, 3 * 3 * 32 + 32 + 21632 * 128 + 128 + 128 * 10 + 10);
  // The input, the convolution's output (flatten only reshapes it), two
  // dense outputs.
  EXPECT_EQ(ActivationsPerExample(*m), 28 * 28 + 26 * 26 * 32 + 128 + 10);
}

// 2^60 values per layer (a 2^30-filter convolution of 32768x32768 images,
// then 8 poolings that keep its size), 9 of them: the sum saturates, where it wrapped around to a
// negative count that any memory check passed.
TEST(ParseModelTest, ActivationsPerExampleSaturates) {
  std::string spec = "conv2d:1073741824:1";
  for (int i = 0; i < 8; ++i) spec += ",maxpool:1";
  spec += ",maxpool:32768,conv2d:1:1,flatten,dense:10";  // variables of 2^30 at most
  auto m = ParseModel(spec, {32768, 32768, 1});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->layers[8].output.size(), int64_t{1} << 60);
  EXPECT_EQ(ActivationsPerExample(*m), std::numeric_limits<int64_t>::max());
}

TEST(ParseModelTest, TwoConvModelNumbersLayersLikeKeras) {
  auto m = ParseModel("two_conv", kMnist);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<std::string> names;
  std::vector<Shape3> outputs;
  for (const auto& l : m->layers) {
    names.push_back(l.name);
    outputs.push_back(l.output);
  }
  EXPECT_THAT(names, ElementsAre("conv2d", "max_pooling2d", "conv2d_1", "max_pooling2d_1",
                                 "flatten", "dense", "dense_1"));
  // "same" convolutions keep the size; each pool halves it: 28 -> 14 -> 7.
  EXPECT_THAT(outputs, ElementsAre(Shape3{28, 28, 32}, Shape3{14, 14, 32}, Shape3{14, 14, 64},
                                   Shape3{7, 7, 64}, Shape3{1, 1, 3136}, Shape3{1, 1, 128},
                                   Shape3{1, 1, 10}));
  EXPECT_EQ(m->layers[1].stride, 2);  // pool stride defaults to the pool size
  EXPECT_THAT(VariableNames(*m),
              ElementsAre("conv2d/kernel", "conv2d/bias", "conv2d_1/kernel", "conv2d_1/bias",
                          "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"));
  EXPECT_THAT(m->variables[2].shape, ElementsAre(3, 3, 32, 64));
  EXPECT_THAT(m->variables[4].shape, ElementsAre(3136, 128));
}

TEST(ParseModelTest, SamePaddingAndStrides) {
  // 7x7: same/s2 -> ceil(7/2) = 4, pad_total = 3*2+3-7 = 2, top 1.
  // then 4x4 valid k2 s2 pool -> 2; then same k4 conv on 2x2 -> 2,
  // pad_total = 1*1+4-2 = 3, top 1 (extra one after).
  auto m = ParseModel("conv2d:4:3:s2:relu:same,maxpool:2,conv2d:3:4:same,flatten,dense:5",
                      Shape3{7, 7, 2});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->layers[0].output, (Shape3{4, 4, 4}));
  EXPECT_EQ(m->layers[0].stride, 2);
  EXPECT_TRUE(m->layers[0].same_padding);
  EXPECT_TRUE(m->layers[0].relu);
  EXPECT_EQ(PadTop(m->layers[0]), 1);
  EXPECT_EQ(PadLeft(m->layers[0]), 1);
  EXPECT_EQ(m->layers[1].output, (Shape3{2, 2, 4}));
  EXPECT_EQ(PadTop(m->layers[1]), 0);
  EXPECT_EQ(m->layers[2].output, (Shape3{2, 2, 3}));
  EXPECT_EQ(PadTop(m->layers[2]), 1);
  EXPECT_THAT(m->variables[2].shape, ElementsAre(4, 4, 4, 3));
  EXPECT_EQ(m->layers[3].output, (Shape3{1, 1, 12}));
}

TEST(ParseModelTest, ValidStridesFloorAndPoolStrideOption) {
  // conv valid k3 s2 on 9x8: (9-3)/2+1 = 4, (8-3)/2+1 = 3; pool k3 s1 on 4x3: 2x1;
  // same pool k2 on 5x5 (stride 2): 3x3, pad_total = 2*2+2-5 = 1, top 0.
  auto m = ParseModel("conv2d:2:3:s2:valid,max_pooling2d:3:s1,flatten,dense:3", Shape3{9, 8, 1});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->layers[0].output, (Shape3{4, 3, 2}));
  EXPECT_EQ(m->layers[1].output, (Shape3{2, 1, 2}));
  EXPECT_EQ(m->layers[1].name, "max_pooling2d");
  EXPECT_EQ(m->layers[1].stride, 1);
  EXPECT_EQ(PadTop(m->layers[0]), 0);

  auto p = ParseModel("maxpool:2:same,flatten,dense:2", Shape3{5, 6, 3});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->layers[0].output, (Shape3{3, 3, 3}));
  EXPECT_EQ(PadTop(p->layers[0]), 0);   // (3-1)*2+2-5 = 1 -> 0 before, 1 after
  EXPECT_EQ(PadLeft(p->layers[0]), 0);  // (3-1)*2+2-6 = 0
  EXPECT_TRUE(p->variables.size() == 2);
}

TEST(ParseModelTest, DenseOnFlatInputNeedsNoFlatten) {
  auto m = ParseModel("dense:4:relu,dense:3", Shape3{1, 1, 6});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(m->variables[0].shape, ElementsAre(6, 4));
  EXPECT_EQ(m->num_classes, 3);
}

// The model's fingerprint follows what the network computes, not how its
// spec is spelled: a worker without the ReLUs has the same variables (the
// plan's fingerprint cannot tell) but another fingerprint.
TEST(ModelFingerprintTest, FollowsLayersAndDataNotSpelling) {
  auto fingerprint = [](const std::string& spec, const char* dataset = "fashion_mnist") {
    auto model = ParseModel(spec, kMnist);
    EXPECT_TRUE(model.ok()) << spec << ": " << model.status();
    return model.ok() ? ModelFingerprint(*model, dataset) : 0;
  };
  const uint64_t seed = fingerprint("seed");
  EXPECT_NE(seed, 0u);
  EXPECT_EQ(fingerprint(kSeedModelSpec), seed);
  EXPECT_EQ(fingerprint(" conv2d : 32 : 3 : relu , flatten,dense:128:relu,dense:10"), seed);
  EXPECT_NE(fingerprint("conv2d:32:3,flatten,dense:128,dense:10"), seed);  // no ReLUs
  EXPECT_NE(fingerprint("conv2d:32:3:relu:same,flatten,dense:128:relu,dense:10"), seed);
  EXPECT_NE(fingerprint("seed", "mnist"), seed);
  // The value is fixed by the encoding, as it travels between processes and
  // builds: FNV-1a 64 of "psflow model 1", the data set's name, the input
  // shape and classes, the layer count, and each layer's kind, units,
  // kernel, stride, same padding and ReLU, as 8-byte little-endian
  // integers (strings after their length); computed apart from
  // docs/PROTOCOL.md by tests/common/plan_reference.py.
  EXPECT_EQ(seed, 0x622aa8d6c4799615u);
}

TEST(ParseModelTest, SpecFileWithCommentsAndNewlines) {
  const std::string path =
      ::testing::TempDir() + "/model_def_test_" + std::to_string(getpid()) + "_spec.txt";
  {
    std::ofstream f(path);
    f << "# a small model\n"
         "conv2d : 8 : 3 : relu   # first layer\n"
         "maxpool:2,\n"
         "\n"
         "  flatten,dense:16:relu\n"
         "dense:10  # logits\n";
  }
  auto from_file = ParseModel("@" + path, kMnist);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  auto inline_spec = ParseModel("conv2d:8:3:relu,maxpool:2,flatten,dense:16:relu,dense:10", kMnist);
  ASSERT_TRUE(inline_spec.ok()) << inline_spec.status();
  EXPECT_EQ(from_file->spec, inline_spec->spec);
  ASSERT_EQ(from_file->layers.size(), 5u);
  EXPECT_EQ(from_file->layers[1].output, (Shape3{13, 13, 8}));
  EXPECT_EQ(VariableNames(*from_file), VariableNames(*inline_spec));
  std::remove(path.c_str());

  auto missing = ParseModel("@/nonexistent/psflow/spec.txt", kMnist);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(),
              HasSubstr("\"/nonexistent/psflow/spec.txt\" cannot be read: No such file"));
  // A path through a file: not "missing", and the reason says why.
  { std::ofstream f(path); }
  auto through_file = ParseModel(absl::StrCat("@", path, "/spec.txt"), kMnist);
  EXPECT_EQ(through_file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(through_file.status().message(), HasSubstr("cannot be read: Not a directory"));

  // A read that fails part way (here EIO from the first byte) is no
  // shorter spec.
  auto unreadable = ParseModel("@/proc/self/mem", kMnist);
  EXPECT_EQ(unreadable.status().code(), absl::StatusCode::kDataLoss) << unreadable.status();
  EXPECT_THAT(unreadable.status().message(), HasSubstr("could not be read to its end"));

  // An error in a spec file names the file and the line.
  {
    std::ofstream f(path);
    f << "# a small model\n"
         "conv2d:8:3:relu,maxpool:2\n"
         "flatten\n"
         "dense:12x  # logits\n";
  }
  auto bad_line = ParseModel("@" + path, kMnist);
  EXPECT_EQ(bad_line.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_line.status().message(),
              HasSubstr("model spec file \"" + path + "\" line 4, token 4 \"dense:12x\": units"));
  std::remove(path.c_str());

  // A directory opens and reads as nothing: it was "a spec without layers".
  // (StrCat: GCC 12 warns -Wrestrict, wrongly, on "@" + std::string here.)
  auto directory = ParseModel(absl::StrCat("@", ::testing::TempDir()), kMnist);
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(directory.status().message(), HasSubstr("is a directory"));
}

// A fifo or a device is no spec file: reading one blocked forever, or (for
// /dev/zero) grew memory without bound. A file too large for a spec is
// refused unread.
TEST(ParseModelTest, SpecFilesThatCannotBeSpecsAreRefused) {
  const std::string fifo =
      ::testing::TempDir() + "/model_def_test_" + std::to_string(getpid()) + "_fifo";
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, std::string("/dev/zero")}) {
    auto model = ParseModel(absl::StrCat("@", path), kMnist);
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
    EXPECT_THAT(model.status().message(), HasSubstr("\"" + path + "\" is not a regular file"));
  }
  std::remove(fifo.c_str());

  const std::string big =
      ::testing::TempDir() + "/model_def_test_" + std::to_string(getpid()) + "_big_spec.txt";
  {
    std::ofstream f(big);
    const std::string line = "dense:10,\n";
    for (size_t written = 0; written <= (64u << 20); written += line.size()) f << line;
  }
  auto model = ParseModel(absl::StrCat("@", big), kMnist);
  std::remove(big.c_str());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
  EXPECT_THAT(model.status().message(), HasSubstr("is larger than 67108864 bytes"));
}

struct ErrorCase {
  std::string spec;
  Shape3 input;
  std::vector<std::string> fragments;  // all must appear in the message
};

TEST(ParseModelTest, ErrorsNameTheTokenAndWhatWasExpected) {
  const std::vector<ErrorCase> cases = {
      {"conv2d:32:3,conv2d:x:3,flatten,dense:10",
       kMnist,
       {"model spec token 2 \"conv2d:x:3\": filters must be a positive integer, got \"x\""}},
      {"conv2d:0:3,flatten,dense:10", kMnist, {"token 1 \"conv2d:0:3\"", "filters", "\"0\""}},
      {"conv2d:8:-1,flatten,dense:10", kMnist, {"token 1", "kernel size", "\"-1\""}},
      {"conv2d:8,flatten,dense:10", kMnist, {"token 1 \"conv2d:8\"", "conv2d:FILTERS:KERNEL"}},
      {"conv2d:8:3:bogus,flatten,dense:10",
       kMnist,
       {"token 1", "unknown option \"bogus\"", "relu", "same", "sSTRIDE"}},
      {"conv2d:8:3:s0,flatten,dense:10", kMnist, {"token 1", "stride", "\"0\""}},
      {"conv2d:8:3:s-1,flatten,dense:10", kMnist, {"token 1", "stride", "\"-1\""}},
      {"conv2d:8:3:sx,flatten,dense:10", kMnist, {"token 1", "unknown option \"sx\"", "sSTRIDE"}},
      {"conv2d:8:3:stride=0,flatten,dense:10",
       kMnist,
       {"token 1", "unknown option \"stride=0\"", "\"sSTRIDE\" (e.g. \"s2\")"}},
      {"conv2d:8:3:same:valid,flatten,dense:10", kMnist, {"token 1", "padding given twice"}},
      {"conv2d:8:3:relu:relu,flatten,dense:10", kMnist, {"token 1", "\"relu\" given twice"}},
      {"maxpool:0,flatten,dense:10", kMnist, {"token 1 \"maxpool:0\"", "pool size"}},
      {"maxpool,flatten,dense:10", kMnist, {"token 1 \"maxpool\"", "maxpool:POOL"}},
      {"maxpool:2:relu,flatten,dense:10", kMnist, {"token 1", "unknown option \"relu\""}},
      {"flatten:3,dense:10", kMnist, {"token 1 \"flatten:3\"", "no options"}},
      {"flatten,dense:abc", kMnist, {"token 2 \"dense:abc\"", "units", "\"abc\""}},
      {"flatten,dense", kMnist, {"token 2 \"dense\"", "dense:UNITS"}},
      {"flatten,dense:10:same", kMnist, {"token 2", "unknown option \"same\"", "relu"}},
      {"lstm:10,dense:10", kMnist, {"token 1 \"lstm:10\"", "unknown layer", "conv2d"}},
      {"seed2", kMnist, {"unknown layer \"seed2\"", "seed or two_conv", "@FILE"}},
      // An integer too large for its field was "not a positive integer".
      {"flatten,dense:3000000000",
       kMnist,
       {"token 2", "units must be at most 2147483647, got 3000000000"}},
      {"conv2d:99999999999999999999999:3,flatten,dense:10",
       kMnist,
       {"token 1", "filters must be at most 2147483647, got 99999999999999999999999"}},
      // Bytes that do not show (a byte-order mark, a NUL) are escaped.
      {"\xEF\xBB\xBF"
       "conv2d:8:3,flatten,dense:10",
       kMnist,
       {"token 1 \"\\xef\\xbb\\xbfconv2d:8:3\"", "unknown layer \"\\xef\\xbb\\xbfconv2d\""}},
      {std::string("conv2d:8:3\0,flatten,dense:10", 28),
       kMnist,
       {"kernel size must be a positive integer, got \"3\\x00\""}},
      {"conv2d:8:3,dense:10",
       kMnist,
       {"token 2 \"dense:10\"", "dense needs a flat input; add flatten before token 2"}},
      {"flatten,dense:10:relu", kMnist, {"token 2 \"dense:10:relu\"", "last layer", "dense"}},
      // A window after the flat layers is out of order, whether or not it
      // would fit (Keras refuses a Conv2D on a flat input too); it was
      // "a 3x3 window ... does not fit the input [1,1,128]".
      {"flatten,dense:10,maxpool:1",
       kMnist,
       {"token 3 \"maxpool:1\"", "max_pooling2d needs an image input, but it comes after dense"}},
      {"flatten,dense:128,conv2d:3:3",
       kMnist,
       {"token 3 \"conv2d:3:3\": conv2d needs an image input, but it comes after dense, whose "
        "output is flat [1,1,128]; expected conv2d and maxpool layers before flatten"}},
      {"conv2d:4:3,flatten,maxpool:2,dense:10",
       kMnist,
       {"max_pooling2d needs an image input, but it comes after flatten, whose output is flat "
        "[1,1,2704]"}},
      {"conv2d:8:30,flatten,dense:10",
       kMnist,
       {"token 1", "conv2d", "[28,28,1]", "output size <= 0"}},
      {"conv2d:4:3,maxpool:5,flatten,dense:2",
       Shape3{6, 6, 1},
       {"token 2 \"maxpool:5\"", "max_pooling2d", "[4,4,4]", "output size <= 0"}},
      // The kernel's element count overflowed int64 and passed the size check.
      {"conv2d:3:2147483647:same,flatten,dense:10",
       kMnist,
       {"token 1", "kernel size must be at most 32768, got 2147483647"}},
      {"conv2d:65536:1,conv2d:2147483647:32768:same,flatten,dense:10",
       kMnist,
       {"token 2", "would have 9223372036854775807 elements"}},
      // in + stride - 1 overflowed int (undefined behaviour).
      {"conv2d:1:3:same:s2147483647,flatten,dense:10", kMnist, {"stride must be at most 32768"}},
  };
  for (const ErrorCase& c : cases) {
    auto m = ParseModel(c.spec, c.input);
    ASSERT_FALSE(m.ok()) << c.spec;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    for (const std::string& f : c.fragments) {
      EXPECT_THAT(m.status().message(), HasSubstr(f)) << c.spec;
    }
  }
}

TEST(ParseModelTest, EmptySpecAndBadInputShapeAreErrors) {
  EXPECT_EQ(ParseModel("", kMnist).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModel(" , ", kMnist).status().code(), absl::StatusCode::kInvalidArgument);
  auto bad = ParseModel("seed", Shape3{0, 28, 1});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("[0,28,1]"));
}

TEST(InitializeVariablesTest, GlorotLimitsZeroBiasesAndDeterminism) {
  auto m = ParseModel("seed", kMnist);
  ASSERT_TRUE(m.ok()) << m.status();
  const auto a = InitializeVariables(*m, 42);
  const auto b = InitializeVariables(*m, 42);
  const auto c = InitializeVariables(*m, 43);
  ASSERT_EQ(a.size(), m->variables.size());
  EXPECT_EQ(a, b);
  // Hand-computed Glorot limits: conv fan_in = 3*3*1, fan_out = 3*3*32.
  const double limits[] = {std::sqrt(6.0 / (9 + 288)),  0, std::sqrt(6.0 / (21632 + 128)), 0,
                           std::sqrt(6.0 / (128 + 10)), 0};
  for (size_t v = 0; v < a.size(); ++v) {
    ASSERT_EQ(static_cast<int64_t>(a[v].size()), m->variables[v].num_elements());
    if (limits[v] == 0) {  // a bias
      for (float x : a[v]) EXPECT_EQ(x, 0.0f) << m->variables[v].name;
      continue;
    }
    double max_abs = 0;
    int64_t differ = 0;
    for (size_t i = 0; i < a[v].size(); ++i) {
      max_abs = std::max(max_abs, std::fabs(double{a[v][i]}));
      differ += a[v][i] != c[v][i];
    }
    EXPECT_LE(max_abs, static_cast<float>(limits[v])) << m->variables[v].name;
    // The largest of >= 288 uniform draws lies within 10% of the limit
    // (failure probability < 0.9^288 ~ 1e-13).
    EXPECT_GT(max_abs, 0.9 * limits[v]) << m->variables[v].name;
    EXPECT_GT(differ, static_cast<int64_t>(a[v].size() * 0.99)) << m->variables[v].name;
  }
}

TEST(InitializeVariablesTest, MomentsOfABigKernelMatchTheUniformDistribution) {
  auto m = ParseModel("seed", kMnist);
  ASSERT_TRUE(m.ok()) << m.status();
  const auto values = InitializeVariables(*m, 7);
  const std::vector<float>& k = values[2];  // dense/kernel, 2.77M values
  const double limit = std::sqrt(6.0 / (21632 + 128));
  double sum = 0, sum_sq = 0, min = 0, max = 0;
  for (float x : k) {
    sum += x;
    sum_sq += double{x} * x;
    min = std::min(min, double{x});
    max = std::max(max, double{x});
  }
  const double n = static_cast<double>(k.size());
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  const double theory_var = limit * limit / 3;
  EXPECT_LT(std::fabs(mean), 5 * std::sqrt(theory_var / n));
  EXPECT_NEAR(var, theory_var, 0.01 * theory_var);
  EXPECT_GT(max, 0.999 * limit);
  EXPECT_LT(min, -0.999 * limit);
}

}  // namespace
}  // namespace psflow::worker
