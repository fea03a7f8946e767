#include "worker/data/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace psflow::worker {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kIdxImagesMagic = 0x00000803;  // uint8, 3 dimensions
constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // uint8, 1 dimension
constexpr int kNumClasses = 10;
constexpr int kCifarSide = 32;
constexpr int kCifarChannels = 3;
constexpr int64_t kCifarImageBytes = kCifarSide * kCifarSide * kCifarChannels;
constexpr int64_t kCifarRecordBytes = 1 + kCifarImageBytes;
// A CIFAR-10 batch file holds 10,000 records; smaller ones are accepted.
constexpr int64_t kCifarMaxRecords = 10000;
// Bound on rows/cols of an IDX image; a larger value means a corrupt header.
constexpr uint32_t kMaxIdxSide = 1 << 15;
// Reads grow their buffer by at most this much at a time, so a corrupt
// header claiming terabytes fails as "truncated" instead of allocating.
constexpr size_t kReadChunk = size_t{16} << 20;

// A file opened through zlib, which reads gzip'd and plain files alike.
class GzReader {
 public:
  static absl::StatusOr<GzReader> Open(const std::string& path) {
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      return absl::NotFoundError(absl::StrCat("file ", path, " does not exist"));
    }
    if (fs::is_directory(path, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("file ", path, " is a directory, expected a data file"));
    }
    // A fifo would block the open until something writes to it.
    if (!fs::is_regular_file(path, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("file ", path,
                       " is not a regular file (a fifo, a socket or a device), "
                       "expected a data file"));
    }
    errno = 0;
    gzFile file = gzopen(path.c_str(), "rb");
    if (file == nullptr) {
      return absl::InternalError(absl::StrCat("cannot open file ", path, ": ",
                                              errno ? std::strerror(errno) : "zlib error"));
    }
    gzbuffer(file, 1 << 17);
    return GzReader(path, file);
  }

  GzReader(GzReader&& other) noexcept
      : path_(std::move(other.path_)),
        file_(std::exchange(other.file_, nullptr)),
        total_out_(other.total_out_) {}
  GzReader& operator=(GzReader&&) = delete;
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }

  const std::string& path() const { return path_; }

  // Appends up to `n` bytes to `out`; stops early only at the end of the
  // file (including a gzip stream that ends early, which zlib reports as
  // end of file). Returns the number of bytes appended.
  absl::StatusOr<size_t> AppendUpTo(size_t n, std::vector<uint8_t>& out) {
    size_t total = 0;
    while (total < n) {
      const size_t chunk = std::min(n - total, kReadChunk);
      const size_t start = out.size();
      out.resize(start + chunk);
      const int got = gzread(file_, out.data() + start, static_cast<unsigned>(chunk));
      if (got < 0) {
        out.resize(start);
        return ZlibError();
      }
      out.resize(start + static_cast<size_t>(got));
      total += static_cast<size_t>(got);
      total_out_ += static_cast<uint64_t>(got);
      if (static_cast<size_t>(got) < chunk) break;
    }
    return total;
  }

  // Reads everything left in the file, which must be at most `limit` bytes
  // (else INVALID_ARGUMENT naming `what`): a small gzip file can expand to
  // gigabytes, so the read stops one byte past the limit.
  absl::StatusOr<std::vector<uint8_t>> ReadAll(size_t limit, const std::string& what) {
    std::vector<uint8_t> out;
    PSFLOW_ASSIGN_OR_RETURN(size_t got, AppendUpTo(limit + 1, out));
    if (got > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("file ", path_, " holds more than ", limit, " bytes; expected ", what));
    }
    PSFLOW_RETURN_IF_ERROR(CheckCleanEnd());
    return out;
  }

  // Reads the last n bytes of the file into `out` (replacing its contents):
  // DATA_LOSS if fewer are left, INVALID_ARGUMENT if more are (`declared`
  // says what the header declared), DATA_LOSS if a gzip'd file lacks its
  // end. The read asks for one byte more than n: zlib notices a gzip stream
  // cut short (even one missing only its 8-byte CRC trailer) only when a
  // read goes past the data.
  absl::Status ReadToEnd(size_t n, std::vector<uint8_t>& out, const char* what,
                         const std::string& declared) {
    out.clear();
    out.reserve(std::min(n + 1, size_t{1} << 28));
    PSFLOW_ASSIGN_OR_RETURN(size_t got, AppendUpTo(n + 1, out));
    if (got < n) {
      return absl::DataLossError(absl::StrCat("file ", path_, " is truncated: expected ", n,
                                              " bytes of ", what, ", found ", got));
    }
    if (got > n) {
      // A corrupt gzip stream can inflate to more than was written: read on
      // to its end, where zlib checks the CRC, before blaming the header.
      // (Bounded: a stream of garbage could go on for gigabytes.)
      if (!gzdirect(file_)) {
        std::vector<uint8_t> sink;
        for (size_t drained = 0; drained < (size_t{1} << 30);) {
          sink.clear();
          PSFLOW_ASSIGN_OR_RETURN(const size_t more, AppendUpTo(kReadChunk, sink));
          drained += more;
          if (more < kReadChunk) {
            PSFLOW_RETURN_IF_ERROR(CheckCleanEnd());
            break;
          }
        }
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "file ", path_, " has more data after the ", declared,
          " its header declares; expected the file to end there (a wrong count in the "
          "header, or two files joined)"));
    }
    return CheckCleanEnd();
  }

 private:
  GzReader(std::string path, gzFile file) : path_(std::move(path)), file_(file) {}

  // At the end of the data: zlib reports a gzip stream cut short (also one
  // missing only its 8-byte trailer) as Z_BUF_ERROR, not as a failed read.
  absl::Status CheckCleanEnd() {
    int errnum = Z_OK;
    gzerror(file_, &errnum);
    if (errnum == Z_OK) return gzdirect(file_) ? absl::OkStatus() : CheckNothingAfterGzip();
    if (errnum == Z_BUF_ERROR) {
      return absl::DataLossError(absl::StrCat("file ", path_,
                                              " is truncated: the gzip stream ends early "
                                              "(expected its end and CRC trailer)"));
    }
    return ZlibError();
  }

  // zlib's reads skip bytes after a gzip stream that do not begin another
  // one, so a gzip'd file with other bytes joined to it (a plain file, say)
  // read as clean. A file that is one gzip member ends with the size of
  // what it holds (mod 2^32), which is checked first; anything else (several
  // members, or bytes after them) has its members walked.
  absl::Status CheckNothingAfterGzip() {
    std::ifstream raw(path_, std::ios::binary | std::ios::ate);
    const std::streamoff size = raw.tellg();
    if (!raw || size < 0) return absl::OkStatus();  // the reads went well: not our question
    if (size >= 4) {
      uint8_t tail[4];
      raw.seekg(size - 4);
      raw.read(reinterpret_cast<char*>(tail), 4);
      const uint32_t isize = uint32_t{tail[0]} | (uint32_t{tail[1]} << 8) |
                             (uint32_t{tail[2]} << 16) | (uint32_t{tail[3]} << 24);
      if (raw && isize == static_cast<uint32_t>(total_out_)) return absl::OkStatus();
    }
    if (static_cast<uint64_t>(size) > std::numeric_limits<uInt>::max()) return absl::OkStatus();
    std::vector<uint8_t> bytes(static_cast<size_t>(size));
    raw.seekg(0);
    raw.read(reinterpret_cast<char*>(bytes.data()), size);
    if (!raw) return absl::OkStatus();
    z_stream z{};
    if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) return absl::OkStatus();
    z.next_in = bytes.data();
    z.avail_in = static_cast<uInt>(bytes.size());
    std::vector<uint8_t> sink(1 << 16);
    absl::Status result = absl::OkStatus();
    while (true) {
      z.next_out = sink.data();
      z.avail_out = static_cast<uInt>(sink.size());
      const int rc = inflate(&z, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        if (z.avail_in == 0) break;
        if (z.avail_in >= 2 && z.next_in[0] == 0x1f && z.next_in[1] == 0x8b) {
          inflateReset(&z);  // another member, as gzip allows
          continue;
        }
        result = absl::InvalidArgumentError(absl::StrCat(
            "file ", path_, " has ", z.avail_in,
            " bytes after its gzip stream; expected the file to end with it (another file "
            "joined to it?)"));
        break;
      }
      if (rc != Z_OK) break;  // zlib's reads said what they found; not ours to add
    }
    inflateEnd(&z);
    return result;
  }

  // The error of a failed read: the system's (an I/O error) or zlib's (a
  // corrupt gzip stream, e.g. a wrong CRC), named once.
  absl::Status ZlibError() {
    int errnum = Z_OK;
    const char* msg = gzerror(file_, &errnum);
    if (errnum == Z_ERRNO) {
      return absl::DataLossError(
          absl::StrCat("file ", path_, " could not be read: ", std::strerror(errno)));
    }
    // zlib's message starts with the path it was opened with; say it once.
    absl::string_view reason = msg == nullptr || *msg == '\0' ? "unknown zlib error" : msg;
    absl::ConsumePrefix(&reason, path_ + ": ");
    return absl::DataLossError(
        absl::StrCat("file ", path_, " is corrupt: ", reason, " (expected a valid gzip stream)"));
  }

  std::string path_;
  gzFile file_;
  uint64_t total_out_ = 0;  // bytes read out of the file, decompressed
};

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads an IDX header: the magic number and `num_dims` dimension sizes.
absl::StatusOr<std::vector<uint32_t>> ReadIdxHeader(GzReader& reader, uint32_t expected_magic,
                                                    int num_dims, const char* kind) {
  // The magic number is checked before the dimensions are read, so a file
  // of the wrong kind is reported as such even when it is shorter.
  const size_t header_bytes = 4 * (1 + static_cast<size_t>(num_dims));
  std::vector<uint8_t> header;
  header.reserve(header_bytes);
  PSFLOW_ASSIGN_OR_RETURN(size_t got, reader.AppendUpTo(4, header));
  if (got == 4 && BigEndian32(header.data()) == expected_magic) {
    PSFLOW_ASSIGN_OR_RETURN(size_t rest, reader.AppendUpTo(header_bytes - 4, header));
    got += rest;
  }
  if (got < 4 || (BigEndian32(header.data()) == expected_magic && got < header_bytes)) {
    return absl::DataLossError(absl::StrCat("file ", reader.path(),
                                            " is truncated: expected ", header_bytes,
                                            " bytes of IDX header, found ", got));
  }
  const uint32_t magic = BigEndian32(header.data());
  if (magic != expected_magic) {
    std::string hint;
    if (magic == kIdxImagesMagic || magic == kIdxLabelsMagic) {
      hint = absl::StrCat(" (that is an IDX ", magic == kIdxImagesMagic ? "images" : "labels",
                          " file; were the images and labels files swapped?)");
    } else if (header[0] == 0x1f && header[1] == 0x8b) {
      hint = " (a gzip header inside the data: was the file compressed twice?)";
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "file %s: wrong magic number for an IDX %s file: expected 0x%08x, found 0x%08x%s",
        reader.path(), kind, expected_magic, magic, hint));
  }
  std::vector<uint32_t> dims(num_dims);
  for (int d = 0; d < num_dims; ++d) dims[d] = BigEndian32(header.data() + 4 * (d + 1));
  return dims;
}

absl::Status CheckLabels(const std::vector<int32_t>& labels, int64_t first_example,
                         const std::string& path) {
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= kNumClasses) {
      return absl::InvalidArgumentError(
          absl::StrCat("file ", path, ": label ", labels[i], " of example ",
                       first_example + static_cast<int64_t>(i), " is outside [0, ",
                       kNumClasses, ")"));
    }
  }
  return absl::OkStatus();
}

// Returns dir/base, or dir/base.gz, whichever exists.
absl::StatusOr<std::string> FindFile(const std::string& dir, const std::string& base) {
  std::error_code ec;
  const fs::path plain = fs::path(dir) / base;
  if (fs::exists(plain, ec)) return plain.string();
  const fs::path gz = fs::path(dir) / (base + ".gz");
  if (fs::exists(gz, ec)) return gz.string();
  return absl::NotFoundError(absl::StrCat("file ", plain.string(), " does not exist (nor ",
                                          gz.string(), ")"));
}

absl::Status CheckDirectory(const std::string& dir, const std::string& data_set,
                            const std::string& hint) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return absl::OkStatus();
  if (fs::exists(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("data directory ", dir, " for data set ",
                                                   data_set, " is not a directory", hint));
  }
  return absl::NotFoundError(
      absl::StrCat("data directory ", dir, " for data set ", data_set, " does not exist", hint));
}

// Both splits hold examples, and of the same shape: the model is built for
// the training split's, and evaluation reads the test split with it.
absl::Status CheckSplitsAgree(const DataSplits& splits, const std::string& dir) {
  for (const Dataset* d : {&splits.train, &splits.test}) {
    if (d->num_examples <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(d->name, " (in ", dir, ") has no examples; expected at least one"));
    }
  }
  const Dataset& a = splits.train;
  const Dataset& b = splits.test;
  if (a.height != b.height || a.width != b.width || a.channels != b.channels) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has %dx%dx%d examples but %s (in %s) has %dx%dx%d; expected both splits to have "
        "one shape",
        b.name, b.height, b.width, b.channels, a.name, dir, a.height, a.width, a.channels));
  }
  return absl::OkStatus();
}

absl::StatusOr<Dataset> LoadIdxSplit(const std::string& dir, const std::string& prefix,
                                     const std::string& name) {
  PSFLOW_ASSIGN_OR_RETURN(std::string images,
                          FindFile(dir, absl::StrCat(prefix, "-images-idx3-ubyte")));
  PSFLOW_ASSIGN_OR_RETURN(std::string labels,
                          FindFile(dir, absl::StrCat(prefix, "-labels-idx1-ubyte")));
  return LoadIdx(images, labels, name);
}

}  // namespace

absl::StatusOr<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                                std::string name) {
  Dataset data;
  data.name = std::move(name);
  data.channels = 1;
  data.num_classes = kNumClasses;

  PSFLOW_ASSIGN_OR_RETURN(GzReader images, GzReader::Open(images_path));
  PSFLOW_ASSIGN_OR_RETURN(std::vector<uint32_t> image_dims,
                          ReadIdxHeader(images, kIdxImagesMagic, 3, "images"));
  const uint32_t rows = image_dims[1], cols = image_dims[2];
  if (rows == 0 || cols == 0 || rows > kMaxIdxSide || cols > kMaxIdxSide) {
    return absl::InvalidArgumentError(absl::StrCat("file ", images_path,
                                                   ": image size must be in [1, ", kMaxIdxSide,
                                                   "] per side, found ", rows, "x", cols));
  }
  data.num_examples = image_dims[0];
  data.height = static_cast<int>(rows);
  data.width = static_cast<int>(cols);

  PSFLOW_ASSIGN_OR_RETURN(GzReader labels, GzReader::Open(labels_path));
  PSFLOW_ASSIGN_OR_RETURN(std::vector<uint32_t> label_dims,
                          ReadIdxHeader(labels, kIdxLabelsMagic, 1, "labels"));
  if (label_dims[0] != image_dims[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image/label count mismatch: images file ", images_path, " holds ", image_dims[0],
        " examples, labels file ", labels_path, " holds ", label_dims[0]));
  }

  const size_t pixel_bytes = static_cast<size_t>(data.num_examples) * rows * cols;
  const std::string declared =
      absl::StrCat(data.num_examples, " example", data.num_examples == 1 ? "" : "s");
  PSFLOW_RETURN_IF_ERROR(images.ReadToEnd(pixel_bytes, data.pixels, "pixels", declared));
  std::vector<uint8_t> label_bytes;
  PSFLOW_RETURN_IF_ERROR(labels.ReadToEnd(static_cast<size_t>(data.num_examples), label_bytes,
                                          "labels", declared));
  data.labels.assign(label_bytes.begin(), label_bytes.end());
  PSFLOW_RETURN_IF_ERROR(CheckLabels(data.labels, 0, labels_path));
  return data;
}

absl::StatusOr<Dataset> LoadCifar10(const std::string& dir, bool train) {
  std::vector<std::string> bases;
  if (train) {
    for (int i = 1; i <= 5; ++i) bases.push_back(absl::StrCat("data_batch_", i, ".bin"));
  } else {
    bases.push_back("test_batch.bin");
  }
  PSFLOW_RETURN_IF_ERROR(CheckDirectory(dir, "cifar10", ""));
  std::string batch_dir = dir;
  std::error_code ec;
  if (!FindFile(dir, bases[0]).ok() && fs::is_directory(fs::path(dir) / "cifar-10-batches-bin", ec)) {
    batch_dir = (fs::path(dir) / "cifar-10-batches-bin").string();
  }

  Dataset data;
  data.name = train ? "cifar10/train" : "cifar10/test";
  data.height = kCifarSide;
  data.width = kCifarSide;
  data.channels = kCifarChannels;
  data.num_classes = kNumClasses;
  for (const std::string& base : bases) {
    PSFLOW_ASSIGN_OR_RETURN(std::string path, FindFile(batch_dir, base));
    PSFLOW_ASSIGN_OR_RETURN(GzReader reader, GzReader::Open(path));
    PSFLOW_ASSIGN_OR_RETURN(
        std::vector<uint8_t> bytes,
        reader.ReadAll(static_cast<size_t>(kCifarMaxRecords * kCifarRecordBytes),
                       absl::StrCat("at most ", kCifarMaxRecords, " records of ",
                                    kCifarRecordBytes, " bytes (a CIFAR-10 batch file)")));
    const int64_t size = static_cast<int64_t>(bytes.size());
    if (size == 0 || size % kCifarRecordBytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file ", path, ": size must be a positive multiple of ", kCifarRecordBytes,
          " (1 label byte + ", kCifarImageBytes, " pixel bytes per record), found ", size,
          " bytes (", size / kCifarRecordBytes, " records and ", size % kCifarRecordBytes,
          " bytes left over)"));
    }
    const int64_t records = size / kCifarRecordBytes;
    const int64_t first = data.num_examples;
    data.pixels.resize(static_cast<size_t>((first + records) * kCifarImageBytes));
    std::vector<int32_t> labels(static_cast<size_t>(records));
    constexpr int kPlane = kCifarSide * kCifarSide;
    for (int64_t r = 0; r < records; ++r) {
      const uint8_t* record = bytes.data() + r * kCifarRecordBytes;
      labels[r] = record[0];
      const uint8_t* chw = record + 1;
      uint8_t* hwc = data.pixels.data() + (first + r) * kCifarImageBytes;
      for (int p = 0; p < kPlane; ++p) {
        for (int c = 0; c < kCifarChannels; ++c) hwc[p * kCifarChannels + c] = chw[c * kPlane + p];
      }
    }
    PSFLOW_RETURN_IF_ERROR(CheckLabels(labels, 0, path));
    data.labels.insert(data.labels.end(), labels.begin(), labels.end());
    data.num_examples += records;
  }
  return data;
}

absl::StatusOr<DataSplits> LoadDataset(const std::string& name, const std::string& data_dir) {
  DataSplits splits;
  if (name == "fashion_mnist" || name == "mnist") {
    const bool fashion = name == "fashion_mnist";
    const std::string dir =
        !data_dir.empty() ? data_dir : (fashion ? kDefaultFashionMnistDir : kDefaultMnistDir);
    std::string hint;
    if (data_dir.empty()) {
      hint = fashion ? " (it is the default; install Debian's dataset-fashion-mnist package or "
                       "pass --data_dir)"
                     : " (it is the default; pass --data_dir)";
    }
    PSFLOW_RETURN_IF_ERROR(CheckDirectory(dir, name, hint));
    PSFLOW_ASSIGN_OR_RETURN(splits.train, LoadIdxSplit(dir, "train", name + "/train"));
    PSFLOW_ASSIGN_OR_RETURN(splits.test, LoadIdxSplit(dir, "t10k", name + "/test"));
    PSFLOW_RETURN_IF_ERROR(CheckSplitsAgree(splits, dir));
    return splits;
  }
  if (name == "cifar10") {
    if (data_dir.empty()) {
      return absl::InvalidArgumentError(
          "data set cifar10 has no default directory: pass --data_dir with the folder holding "
          "data_batch_1.bin .. data_batch_5.bin and test_batch.bin");
    }
    PSFLOW_ASSIGN_OR_RETURN(splits.train, LoadCifar10(data_dir, /*train=*/true));
    PSFLOW_ASSIGN_OR_RETURN(splits.test, LoadCifar10(data_dir, /*train=*/false));
    PSFLOW_RETURN_IF_ERROR(CheckSplitsAgree(splits, data_dir));
    return splits;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown data set \"", name, "\": expected one of fashion_mnist, mnist, cifar10"));
}

}  // namespace psflow::worker
