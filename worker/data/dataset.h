// In-memory image-classification data sets and their file readers.
//
// Examples are kept as uint8 pixels (Fashion-MNIST's 60,000 training images
// take 47 MB this way instead of 188 MB as float; CIFAR-10's 50,000 take
// 154 MB instead of 614 MB). They become floats in [0, 1] only when a batch
// is assembled (see batcher.h).
//
// Readers:
//  * IDX, the MNIST / Fashion-MNIST format: an images file (magic
//    0x00000803, count, rows, cols, then count*rows*cols bytes) and a labels
//    file (magic 0x00000801, count, then count bytes), big-endian headers,
//    gzip'd or not (zlib reads both transparently).
//  * CIFAR-10 binary: records of 1 label byte followed by 3072 pixel bytes in
//    CHW order (1024 red, 1024 green, 1024 blue; 32x32), converted to HWC.
//
// Errors (every message names the file and the expected vs found value):
//   NOT_FOUND         a file or the data directory does not exist
//   INVALID_ARGUMENT  a data directory that is a file, a data file that is a
//                     directory, a fifo or a device, wrong magic number,
//                     bad dimensions, image/label count
//                     mismatch, label outside [0, num_classes), CIFAR-10 file
//                     size not a multiple of 3073 or empty, unknown data set
//                     name, cifar10 without a directory
//   DATA_LOSS         truncated file or corrupt gzip stream
//   INTERNAL          the file exists but cannot be opened or read
// Nothing is ever downloaded.
#ifndef PSFLOW_WORKER_DATA_DATASET_H_
#define PSFLOW_WORKER_DATA_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace psflow::worker {

// A labelled image data set held in memory. Plain value type; immutable
// once loaded, so any number of threads may read it concurrently.
struct Dataset {
  std::string name;  // "fashion_mnist/train", "cifar10/test", ...
  int height = 0, width = 0, channels = 0, num_classes = 10;
  int64_t num_examples = 0;
  // num_examples * example_size() bytes; example i starts at
  // i * example_size() and is stored NHWC (channels last).
  std::vector<uint8_t> pixels;
  std::vector<int32_t> labels;  // num_examples entries in [0, num_classes)

  int64_t example_size() const {
    return static_cast<int64_t>(height) * width * channels;
  }
};

// Reads an IDX images file and its labels file (each gzip'd or not) into a
// data set named `name` with channels = 1 and num_classes = 10.
absl::StatusOr<Dataset> LoadIdx(const std::string& images_path,
                                const std::string& labels_path,
                                std::string name);

// Reads CIFAR-10 binary batches from `dir`: data_batch_1.bin ..
// data_batch_5.bin when `train`, else test_batch.bin (each may also be
// present as NAME.gz). When `dir` lacks them but holds the
// cifar-10-batches-bin/ folder of the official archive, that folder is used.
// The result is 32x32x3, named "cifar10/train" or "cifar10/test".
absl::StatusOr<Dataset> LoadCifar10(const std::string& dir, bool train);

struct DataSplits {
  Dataset train, test;
};

// Default directories, used when LoadDataset's data_dir is "".
inline constexpr char kDefaultFashionMnistDir[] =
    "/usr/share/datasets/fashion-mnist";  // Debian's dataset-fashion-mnist
inline constexpr char kDefaultMnistDir[] = "/usr/share/datasets/mnist";

// Loads both splits of the named data set:
//   "fashion_mnist", "mnist": train-images-idx3-ubyte, train-labels-idx1-ubyte,
//       t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each with or
//       without .gz, from data_dir (default: the directories above);
//   "cifar10": LoadCifar10(data_dir, ...); there is no default directory.
absl::StatusOr<DataSplits> LoadDataset(const std::string& name,
                                       const std::string& data_dir);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_DATA_DATASET_H_
