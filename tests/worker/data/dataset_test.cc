#include "worker/data/dataset.h"

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;

// Removes the test directories once every test has passed (they are kept
// for a look when one failed).
class TestDirs : public ::testing::Environment {
 public:
  static TestDirs* Get() {
    static TestDirs* const dirs =
        static_cast<TestDirs*>(::testing::AddGlobalTestEnvironment(new TestDirs));
    return dirs;
  }
  void Add(const fs::path& dir) { dirs_.push_back(dir); }
  void TearDown() override {
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    std::error_code error;
    for (const fs::path& dir : dirs_) fs::remove_all(dir, error);
  }

 private:
  std::vector<fs::path> dirs_;
};
[[maybe_unused]] TestDirs* const register_test_dirs = TestDirs::Get();  // before main runs

// A fresh directory per test, its name this process's own (a second run of
// these tests at the same time used to remove the first one's files).
std::string TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir =
      fs::path(::testing::TempDir()) /
      absl::StrCat("psflow_data_", getpid(), "_", info->test_suite_name(), "_", info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  TestDirs::Get()->Add(dir);
  return dir.string();
}

void PutBigEndian(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

// The file's bytes as they are on disk (still gzip'd, if they are).
std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr) << path;
    if (!bytes.empty()) {
      ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
                static_cast<int>(bytes.size()));
    }
    ASSERT_EQ(gzclose(f), Z_OK);
  } else {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << path;
  }
}

std::vector<uint8_t> IdxImages(uint32_t count, uint32_t rows, uint32_t cols,
                               const std::vector<uint8_t>& pixels, uint32_t magic = kImagesMagic) {
  std::vector<uint8_t> out;
  PutBigEndian(out, magic);
  PutBigEndian(out, count);
  PutBigEndian(out, rows);
  PutBigEndian(out, cols);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

std::vector<uint8_t> IdxLabels(const std::vector<uint8_t>& labels, uint32_t magic = kLabelsMagic,
                               int64_t count = -1) {
  std::vector<uint8_t> out;
  PutBigEndian(out, magic);
  PutBigEndian(out, count < 0 ? static_cast<uint32_t>(labels.size()) : static_cast<uint32_t>(count));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

// Example e, pixel p of a 2x3 image: a value that differs everywhere.
uint8_t SmallPixel(int e, int p) { return static_cast<uint8_t>(e * 40 + p * 5 + 1); }

struct SmallIdx {
  std::string images, labels;
};

// Writes 4 examples of 2x3 pixels with labels 3, 0, 9, 7.
SmallIdx WriteSmallIdx(const std::string& dir, bool gzip) {
  std::vector<uint8_t> pixels;
  for (int e = 0; e < 4; ++e) {
    for (int p = 0; p < 6; ++p) pixels.push_back(SmallPixel(e, p));
  }
  const std::string suffix = gzip ? ".gz" : "";
  SmallIdx files{dir + "/images-idx3-ubyte" + suffix, dir + "/labels-idx1-ubyte" + suffix};
  WriteFile(files.images, IdxImages(4, 2, 3, pixels), gzip);
  WriteFile(files.labels, IdxLabels({3, 0, 9, 7}), gzip);
  return files;
}

void ExpectSmallIdx(const Dataset& data) {
  EXPECT_EQ(data.num_examples, 4);
  EXPECT_EQ(data.height, 2);
  EXPECT_EQ(data.width, 3);
  EXPECT_EQ(data.channels, 1);
  EXPECT_EQ(data.num_classes, 10);
  EXPECT_EQ(data.example_size(), 6);
  ASSERT_EQ(data.pixels.size(), 24u);
  for (int e = 0; e < 4; ++e) {
    for (int p = 0; p < 6; ++p) EXPECT_EQ(data.pixels[e * 6 + p], SmallPixel(e, p)) << e << "," << p;
  }
  EXPECT_EQ(data.labels, (std::vector<int32_t>{3, 0, 9, 7}));
}

TEST(LoadIdxTest, LoadsPlainFiles) {
  const SmallIdx files = WriteSmallIdx(TestDir(), /*gzip=*/false);
  absl::StatusOr<Dataset> data = LoadIdx(files.images, files.labels, "small/train");
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->name, "small/train");
  ExpectSmallIdx(*data);
}

TEST(LoadIdxTest, LoadsGzippedFiles) {
  const SmallIdx files = WriteSmallIdx(TestDir(), /*gzip=*/true);
  std::ifstream in(files.images, std::ios::binary);
  unsigned char magic[2] = {0, 0};
  in.read(reinterpret_cast<char*>(magic), 2);
  ASSERT_EQ(magic[0], 0x1f);  // really gzip'd
  ASSERT_EQ(magic[1], 0x8b);
  absl::StatusOr<Dataset> data = LoadIdx(files.images, files.labels, "small/train");
  ASSERT_TRUE(data.ok()) << data.status();
  ExpectSmallIdx(*data);
}

TEST(LoadIdxTest, MissingFileIsNotFoundAndNamesIt) {
  const SmallIdx files = WriteSmallIdx(TestDir(), false);
  const std::string missing = files.labels + ".nope";
  absl::StatusOr<Dataset> data = LoadIdx(files.images, missing, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(data.status().message(), HasSubstr(missing));
}

TEST(LoadIdxTest, TruncatedPixelsAreDataLoss) {
  const std::string dir = TestDir();
  for (bool gzip : {false, true}) {
    const std::string images = dir + (gzip ? "/short.gz" : "/short");
    const std::string labels = dir + "/labels";
    // 3 examples of 2x3 claimed (18 bytes), 12 present.
    WriteFile(images, IdxImages(3, 2, 3, std::vector<uint8_t>(12, 7)), gzip);
    WriteFile(labels, IdxLabels({1, 2, 3}), false);
    absl::StatusOr<Dataset> data = LoadIdx(images, labels, "x");
    EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss) << data.status();
    EXPECT_THAT(data.status().message(),
                AllOf(HasSubstr(images), HasSubstr("expected 18"), HasSubstr("found 12")));
  }
}

TEST(LoadIdxTest, GzipStreamCutShortIsDataLoss) {
  const std::string dir = TestDir();
  std::vector<uint8_t> pixels(5000);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  const std::string full = dir + "/full.gz";
  WriteFile(full, IdxImages(50, 10, 10, pixels), true);
  std::vector<uint8_t> bytes = ReadFile(full);
  ASSERT_GT(bytes.size(), 200u);
  bytes.resize(bytes.size() / 2);
  const std::string cut = dir + "/cut.gz";
  WriteFile(cut, bytes, false);
  const std::string labels = dir + "/labels";
  WriteFile(labels, IdxLabels(std::vector<uint8_t>(50, 1)), false);
  absl::StatusOr<Dataset> data = LoadIdx(cut, labels, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss) << data.status();
  EXPECT_THAT(data.status().message(), HasSubstr(cut));
}

// zlib checks a gzip file's CRC trailer only when a read goes past the
// data; a file cut just before its 8-byte trailer used to load silently.
TEST(LoadIdxTest, GzipWithoutItsTrailerIsDataLoss) {
  const std::string dir = TestDir();
  const SmallIdx files = WriteSmallIdx(dir, /*gzip=*/true);
  std::vector<uint8_t> bytes = ReadFile(files.images);
  ASSERT_GT(bytes.size(), 8u);
  bytes.resize(bytes.size() - 8);
  const std::string cut = dir + "/no_trailer.gz";
  WriteFile(cut, bytes, false);
  absl::StatusOr<Dataset> data = LoadIdx(cut, files.labels, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss) << data.status();
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(cut), HasSubstr("ends early")));
}

// A wrong CRC is corruption, not truncation; zlib's own message carries the
// path, which the error names once.
TEST(LoadIdxTest, GzipWithAWrongCrcIsDataLoss) {
  const std::string dir = TestDir();
  const SmallIdx files = WriteSmallIdx(dir, /*gzip=*/true);
  std::vector<uint8_t> bytes = ReadFile(files.images);
  ASSERT_GT(bytes.size(), 8u);
  bytes[bytes.size() - 8] ^= 0xff;  // the CRC-32's first byte
  const std::string bad = dir + "/bad_crc.gz";
  WriteFile(bad, bytes, false);
  absl::StatusOr<Dataset> data = LoadIdx(bad, files.labels, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss) << data.status();
  const std::string message(data.status().message());
  EXPECT_THAT(message, AllOf(HasSubstr("is corrupt"), HasSubstr("incorrect data check")));
  ASSERT_NE(message.find(bad), std::string::npos) << message;
  EXPECT_EQ(message.find(bad, message.find(bad) + 1), std::string::npos) << message;
}

// A header that declares fewer examples than the file holds (a wrong count,
// or two files joined) used to load the first ones silently.
TEST(LoadIdxTest, DataAfterTheDeclaredExamplesIsInvalidArgument) {
  const std::string dir = TestDir();
  for (bool gzip : {false, true}) {
    const std::string images = dir + (gzip ? "/long.gz" : "/long");
    const std::string labels = dir + (gzip ? "/labels.gz" : "/labels");
    // 2 examples of 2x3 declared (12 bytes), 18 present.
    WriteFile(images, IdxImages(2, 2, 3, std::vector<uint8_t>(18, 7)), gzip);
    WriteFile(labels, IdxLabels({1, 2}), gzip);
    absl::StatusOr<Dataset> data = LoadIdx(images, labels, "x");
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << data.status();
    EXPECT_THAT(data.status().message(),
                AllOf(HasSubstr(images), HasSubstr("more data after the 2 examples")));
    // The same for the labels file.
    WriteFile(images, IdxImages(2, 2, 3, std::vector<uint8_t>(12, 7)), gzip);
    WriteFile(labels, IdxLabels({1, 2, 3}, kLabelsMagic, 2), gzip);
    data = LoadIdx(images, labels, "x");
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << data.status();
    EXPECT_THAT(data.status().message(), HasSubstr(labels));
  }
}

// A corrupt gzip stream can inflate to more bytes than its header declares:
// that is corruption (its CRC fails at the end), not a wrong count. The
// examples are large, so that the CRC is checked only after the bytes the
// header declares have been read (zlib inflates 256 KiB ahead).
TEST(LoadIdxTest, CorruptGzipThatInflatesTooLongIsDataLoss) {
  const std::string dir = TestDir();
  const std::string images = dir + "/long_bad_crc.gz";
  const std::string labels = dir + "/labels";
  WriteFile(images, IdxImages(2, 512, 512, std::vector<uint8_t>(3 * 512 * 512, 7)), true);
  std::vector<uint8_t> bytes = ReadFile(images);
  ASSERT_GT(bytes.size(), 8u);
  bytes[bytes.size() - 8] ^= 0xff;  // the CRC-32's first byte
  WriteFile(images, bytes, false);
  WriteFile(labels, IdxLabels({1, 2}), false);
  absl::StatusOr<Dataset> data = LoadIdx(images, labels, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss) << data.status();
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(images), HasSubstr("is corrupt"), HasSubstr("incorrect data check")));
}

// zlib's reads skip bytes after a gzip stream that do not begin another
// one: a gzip'd file with junk or a plain file joined to it loaded as clean.
// A file of several gzip members is a valid gzip file.
TEST(LoadIdxTest, BytesAfterTheGzipStreamAreInvalidArgument) {
  const std::string dir = TestDir();
  const std::vector<uint8_t> plain = IdxImages(2, 2, 3, std::vector<uint8_t>(12, 7));
  const std::string labels = dir + "/labels.gz";
  WriteFile(labels, IdxLabels({1, 2}), true);
  const std::string gz = dir + "/images.gz";
  WriteFile(gz, plain, true);
  const std::vector<uint8_t> compressed = ReadFile(gz);
  const std::string junk_text = "GARBAGE_TRAILING_BYTES";
  for (const std::vector<uint8_t>& after :
       {std::vector<uint8_t>(junk_text.begin(), junk_text.end()), plain}) {
    std::vector<uint8_t> bytes = compressed;
    bytes.insert(bytes.end(), after.begin(), after.end());
    WriteFile(gz, bytes, false);
    absl::StatusOr<Dataset> data = LoadIdx(gz, labels, "x");
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << data.status();
    EXPECT_THAT(data.status().message(),
                AllOf(HasSubstr(gz), HasSubstr(absl::StrCat(after.size(),
                                                            " bytes after its gzip "
                                                            "stream"))));
  }
  // Two members, the header in one and the pixels in the other: loads.
  const std::string head = dir + "/head.gz", tail = dir + "/tail.gz";
  WriteFile(head, std::vector<uint8_t>(plain.begin(), plain.begin() + 16), true);
  WriteFile(tail, std::vector<uint8_t>(plain.begin() + 16, plain.end()), true);
  std::vector<uint8_t> two = ReadFile(head);
  const std::vector<uint8_t> second = ReadFile(tail);
  two.insert(two.end(), second.begin(), second.end());
  WriteFile(gz, two, false);
  absl::StatusOr<Dataset> data = LoadIdx(gz, labels, "x");
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->num_examples, 2);
}

TEST(LoadIdxTest, TruncatedHeaderIsDataLoss) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", {0, 0, 8, 3, 0, 0}, false);
  WriteFile(dir + "/labels", IdxLabels({1}), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(dir + "/images"), HasSubstr("expected 16"), HasSubstr("found 6")));
}

TEST(LoadIdxTest, TruncatedLabelsAreDataLoss) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", IdxImages(3, 1, 1, {1, 2, 3}), false);
  WriteFile(dir + "/labels", IdxLabels({1, 2}, kLabelsMagic, /*count=*/3), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(dir + "/labels"), HasSubstr("expected 3"), HasSubstr("found 2")));
}

TEST(LoadIdxTest, WrongMagicIsInvalidArgumentWithBothValues) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", IdxImages(1, 1, 1, {1}, /*magic=*/0x00000804), false);
  WriteFile(dir + "/labels", IdxLabels({1}), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(dir + "/images"), HasSubstr("0x00000803"), HasSubstr("0x00000804")));

  WriteFile(dir + "/images", IdxImages(1, 1, 1, {1}), false);
  WriteFile(dir + "/labels", IdxLabels({1}, /*magic=*/0x12345678), false);
  data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(dir + "/labels"), HasSubstr("0x00000801"), HasSubstr("0x12345678")));
}

TEST(LoadIdxTest, SwappedFilesAreReported) {
  const SmallIdx files = WriteSmallIdx(TestDir(), false);
  absl::StatusOr<Dataset> data = LoadIdx(files.labels, files.images, "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(files.labels), HasSubstr("swapped")));
}

TEST(LoadIdxTest, CountMismatchNamesBothFiles) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", IdxImages(3, 1, 2, {1, 2, 3, 4, 5, 6}), false);
  WriteFile(dir + "/labels", IdxLabels({1, 2}), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(dir + "/images"), HasSubstr(dir + "/labels"),
                                             HasSubstr("3"), HasSubstr("2")));
}

TEST(LoadIdxTest, LabelOutOfRangeIsInvalidArgument) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", IdxImages(3, 1, 1, {1, 2, 3}), false);
  WriteFile(dir + "/labels", IdxLabels({4, 10, 2}), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(),
              AllOf(HasSubstr(dir + "/labels"), HasSubstr("label 10"), HasSubstr("example 1")));
}

TEST(LoadIdxTest, ZeroSizedImagesAreInvalidArgument) {
  const std::string dir = TestDir();
  WriteFile(dir + "/images", IdxImages(1, 0, 28, {}), false);
  WriteFile(dir + "/labels", IdxLabels({1}), false);
  absl::StatusOr<Dataset> data = LoadIdx(dir + "/images", dir + "/labels", "x");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(dir + "/images"), HasSubstr("0x28")));
}

// CIFAR-10 test data: pixel (channel c, row y, col x) of record r of file f.
uint8_t CifarPixel(int f, int r, int c, int y, int x) {
  return static_cast<uint8_t>(f * 101 + r * 37 + c * 85 + y * 7 + x * 3);
}
int CifarLabel(int f, int r) { return (f * 3 + r) % 10; }

// Writes `records` CHW records as the official format lays them out.
void WriteCifarFile(const std::string& path, int f, int records, bool gzip) {
  std::vector<uint8_t> bytes;
  for (int r = 0; r < records; ++r) {
    bytes.push_back(static_cast<uint8_t>(CifarLabel(f, r)));
    for (int c = 0; c < 3; ++c) {
      for (int y = 0; y < 32; ++y) {
        for (int x = 0; x < 32; ++x) bytes.push_back(CifarPixel(f, r, c, y, x));
      }
    }
  }
  WriteFile(path, bytes, gzip);
}

// data_batch_i.bin holds i records (f = i); test_batch.bin 2 records (f = 0).
void WriteCifarDir(const std::string& dir, bool gzip_test) {
  for (int i = 1; i <= 5; ++i) {
    WriteCifarFile(absl::StrCat(dir, "/data_batch_", i, ".bin"), i, i, false);
  }
  WriteCifarFile(dir + "/test_batch.bin" + (gzip_test ? ".gz" : ""), 0, 2, gzip_test);
}

TEST(LoadCifar10Test, ConvertsChwToHwcAndKeepsLabels) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, /*gzip_test=*/true);
  absl::StatusOr<Dataset> train = LoadCifar10(dir, /*train=*/true);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->name, "cifar10/train");
  EXPECT_EQ(train->num_examples, 1 + 2 + 3 + 4 + 5);
  EXPECT_EQ(train->height, 32);
  EXPECT_EQ(train->width, 32);
  EXPECT_EQ(train->channels, 3);
  ASSERT_EQ(train->pixels.size(), 15u * 3072);
  ASSERT_EQ(train->labels.size(), 15u);
  int64_t e = 0;
  for (int f = 1; f <= 5; ++f) {
    for (int r = 0; r < f; ++r, ++e) {
      EXPECT_EQ(train->labels[e], CifarLabel(f, r));
      const uint8_t* hwc = train->pixels.data() + e * 3072;
      // Spot pixels, then the whole image.
      EXPECT_EQ(hwc[(5 * 32 + 9) * 3 + 2], CifarPixel(f, r, 2, 5, 9));
      for (int y = 0; y < 32; ++y) {
        for (int x = 0; x < 32; ++x) {
          for (int c = 0; c < 3; ++c) {
            ASSERT_EQ(hwc[(y * 32 + x) * 3 + c], CifarPixel(f, r, c, y, x))
                << "example " << e << " y=" << y << " x=" << x << " c=" << c;
          }
        }
      }
    }
  }
  absl::StatusOr<Dataset> test = LoadCifar10(dir, /*train=*/false);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->name, "cifar10/test");
  ASSERT_EQ(test->num_examples, 2);
  EXPECT_EQ(test->labels[1], CifarLabel(0, 1));
  EXPECT_EQ(test->pixels[3072 + (31 * 32 + 0) * 3 + 1], CifarPixel(0, 1, 1, 31, 0));
}

TEST(LoadCifar10Test, FindsTheArchiveFolder) {
  const std::string dir = TestDir();
  fs::create_directories(dir + "/cifar-10-batches-bin");
  WriteCifarDir(dir + "/cifar-10-batches-bin", false);
  absl::StatusOr<Dataset> test = LoadCifar10(dir, /*train=*/false);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->num_examples, 2);
}

TEST(LoadCifar10Test, SizeNotMultipleOfRecordIsInvalidArgument) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, false);
  std::vector<uint8_t> bytes(3073 * 2 + 100, 1);
  WriteFile(dir + "/test_batch.bin", bytes, false);
  absl::StatusOr<Dataset> test = LoadCifar10(dir, /*train=*/false);
  EXPECT_EQ(test.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(test.status().message(), AllOf(HasSubstr(dir + "/test_batch.bin"),
                                             HasSubstr("3073"), HasSubstr("6246")));
}

TEST(LoadCifar10Test, MissingBatchIsNotFound) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, false);
  fs::remove(dir + "/data_batch_3.bin");
  absl::StatusOr<Dataset> train = LoadCifar10(dir, /*train=*/true);
  EXPECT_EQ(train.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(train.status().message(), HasSubstr(dir + "/data_batch_3.bin"));
}

TEST(LoadCifar10Test, LabelOutOfRangeIsInvalidArgument) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, false);
  std::vector<uint8_t> bytes(3073 * 2, 0);
  bytes[3073] = 11;  // label of record 1
  WriteFile(dir + "/test_batch.bin", bytes, false);
  absl::StatusOr<Dataset> test = LoadCifar10(dir, /*train=*/false);
  EXPECT_EQ(test.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(test.status().message(),
              AllOf(HasSubstr(dir + "/test_batch.bin"), HasSubstr("label 11")));
}

// A batch file holds at most 10,000 records: a small gzip file that expands
// beyond that used to be read whole (1.9 GB for an 896 KB file).
TEST(LoadCifar10Test, BatchOfMoreThanTenThousandRecordsIsRefused) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, false);
  WriteFile(dir + "/test_batch.bin.gz", std::vector<uint8_t>(3073 * 10001, 0), true);
  fs::remove(dir + "/test_batch.bin");
  absl::StatusOr<Dataset> test = LoadCifar10(dir, /*train=*/false);
  EXPECT_EQ(test.status().code(), absl::StatusCode::kInvalidArgument) << test.status();
  EXPECT_THAT(test.status().message(),
              AllOf(HasSubstr(dir + "/test_batch.bin.gz"), HasSubstr("at most 10000 records")));
}

// Writes a complete fashion_mnist-style directory: train has 5 examples of
// 2x2, test 3; pixel values encode (split, example, pixel).
void WriteMnistDir(const std::string& dir) {
  auto images = [](int split, int n) {
    std::vector<uint8_t> px;
    for (int e = 0; e < n; ++e) {
      for (int p = 0; p < 4; ++p) px.push_back(static_cast<uint8_t>(split * 100 + e * 10 + p));
    }
    return IdxImages(n, 2, 2, px);
  };
  WriteFile(dir + "/train-images-idx3-ubyte.gz", images(0, 5), true);
  WriteFile(dir + "/train-labels-idx1-ubyte", IdxLabels({0, 1, 2, 3, 4}), false);
  WriteFile(dir + "/t10k-images-idx3-ubyte", images(1, 3), false);
  WriteFile(dir + "/t10k-labels-idx1-ubyte.gz", IdxLabels({9, 8, 7}), true);
}

TEST(LoadDatasetTest, LoadsBothSplitsWithOrWithoutGz) {
  const std::string dir = TestDir();
  WriteMnistDir(dir);
  for (const std::string name : {"fashion_mnist", "mnist"}) {
    absl::StatusOr<DataSplits> splits = LoadDataset(name, dir);
    ASSERT_TRUE(splits.ok()) << splits.status();
    EXPECT_EQ(splits->train.name, name + "/train");
    EXPECT_EQ(splits->test.name, name + "/test");
    EXPECT_EQ(splits->train.num_examples, 5);
    EXPECT_EQ(splits->test.num_examples, 3);
    EXPECT_EQ(splits->train.pixels[4 * 4 + 3], 0 * 100 + 4 * 10 + 3);
    EXPECT_EQ(splits->test.pixels[2 * 4 + 1], 1 * 100 + 2 * 10 + 1);
    EXPECT_EQ(splits->test.labels, (std::vector<int32_t>{9, 8, 7}));
  }
}

// The model is built for the training split's shape and evaluates the test
// split with it: a test split of another shape read past a buffer's end.
TEST(LoadDatasetTest, SplitsOfDifferentShapesOrAnEmptyOneAreRefused) {
  const std::string dir = TestDir();
  WriteMnistDir(dir);
  WriteFile(dir + "/t10k-images-idx3-ubyte", IdxImages(3, 3, 3, std::vector<uint8_t>(27, 1)),
            false);
  absl::StatusOr<DataSplits> splits = LoadDataset("fashion_mnist", dir);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument) << splits.status();
  EXPECT_THAT(splits.status().message(),
              AllOf(HasSubstr("fashion_mnist/test has 3x3x1"), HasSubstr("has 2x2x1")));

  WriteFile(dir + "/t10k-images-idx3-ubyte", IdxImages(0, 2, 2, {}), false);
  WriteFile(dir + "/t10k-labels-idx1-ubyte.gz", IdxLabels({}), true);
  splits = LoadDataset("fashion_mnist", dir);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument) << splits.status();
  EXPECT_THAT(splits.status().message(), HasSubstr("fashion_mnist/test (in " + dir + ") has no examples"));
}

TEST(LoadDatasetTest, MissingSplitFileIsNotFound) {
  const std::string dir = TestDir();
  WriteMnistDir(dir);
  fs::remove(dir + "/t10k-labels-idx1-ubyte.gz");
  absl::StatusOr<DataSplits> splits = LoadDataset("fashion_mnist", dir);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(splits.status().message(), HasSubstr(dir + "/t10k-labels-idx1-ubyte"));
}

TEST(LoadDatasetTest, MissingDirectoryIsNotFound) {
  const std::string dir = TestDir() + "/absent";
  absl::StatusOr<DataSplits> splits = LoadDataset("mnist", dir);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(splits.status().message(), HasSubstr(dir));
}

// A plain file given as the directory was said not to exist.
TEST(LoadDatasetTest, AFileGivenAsTheDirectoryIsNamedSo) {
  const std::string file = TestDir() + "/plain";
  WriteFile(file, {1, 2, 3}, false);
  absl::StatusOr<DataSplits> splits = LoadDataset("mnist", file);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument) << splits.status();
  EXPECT_THAT(splits.status().message(),
              HasSubstr(file + " for data set mnist is not a directory"));
}

// A fifo in place of a data file blocked the worker in its open, for good.
TEST(LoadDatasetTest, AFifoInPlaceOfADataFileIsRefused) {
  const std::string dir = TestDir();
  WriteMnistDir(dir);
  fs::remove(dir + "/train-images-idx3-ubyte.gz");
  const std::string fifo = dir + "/train-images-idx3-ubyte";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  absl::StatusOr<DataSplits> splits = LoadDataset("fashion_mnist", dir);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument) << splits.status();
  EXPECT_THAT(splits.status().message(), HasSubstr(fifo + " is not a regular file"));
}

TEST(LoadDatasetTest, UnknownNameListsTheChoices) {
  absl::StatusOr<DataSplits> splits = LoadDataset("imagenet", "/tmp");
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(splits.status().message(), AllOf(HasSubstr("imagenet"), HasSubstr("fashion_mnist"),
                                               HasSubstr("mnist"), HasSubstr("cifar10")));
}

TEST(LoadDatasetTest, Cifar10NeedsADirectory) {
  absl::StatusOr<DataSplits> splits = LoadDataset("cifar10", "");
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(splits.status().message(), HasSubstr("--data_dir"));
}

TEST(LoadDatasetTest, Cifar10FromADirectory) {
  const std::string dir = TestDir();
  WriteCifarDir(dir, false);
  absl::StatusOr<DataSplits> splits = LoadDataset("cifar10", dir);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->train.num_examples, 15);
  EXPECT_EQ(splits->test.num_examples, 2);
}

// The real thing: Debian's dataset-fashion-mnist, which the test command
// installs (deploy/setup.sh), as the cluster tests need it too.
TEST(LoadDatasetTest, RealFashionMnist) {
  ASSERT_TRUE(fs::is_directory(kDefaultFashionMnistDir))
      << kDefaultFashionMnistDir << " is absent (apt install dataset-fashion-mnist)";
  absl::StatusOr<DataSplits> splits = LoadDataset("fashion_mnist", "");
  ASSERT_TRUE(splits.ok()) << splits.status();
  struct Expect {
    const Dataset* data;
    int64_t count;
  };
  for (const Expect& e : {Expect{&splits->train, 60000}, Expect{&splits->test, 10000}}) {
    const Dataset& d = *e.data;
    EXPECT_EQ(d.num_examples, e.count) << d.name;
    EXPECT_EQ(d.height, 28);
    EXPECT_EQ(d.width, 28);
    EXPECT_EQ(d.channels, 1);
    EXPECT_EQ(d.pixels.size(), static_cast<size_t>(e.count) * 784);
    // Fashion-MNIST is balanced: a tenth of each split per class.
    std::vector<int64_t> per_class(10, 0);
    for (int32_t label : d.labels) {
      ASSERT_GE(label, 0);
      ASSERT_LT(label, 10);
      ++per_class[label];
    }
    for (int c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], e.count / 10) << d.name << " class " << c;
    // Not all black: images have a white-ish maximum and a black background.
    uint8_t max_pixel = 0;
    for (uint8_t p : d.pixels) max_pixel = std::max(max_pixel, p);
    EXPECT_EQ(max_pixel, 255);
    EXPECT_EQ(d.pixels[0], 0);  // top-left corner of the first image
  }
}

}  // namespace
}  // namespace psflow::worker
