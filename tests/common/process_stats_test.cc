// The memory limit a shard derives its default --max_variable_bytes from,
// and the CPU quota the automatic thread counts keep to: cgroup v2 and v1
// files laid out in a temporary directory.
#include "common/process_stats.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace psflow {
namespace {

namespace fs = std::filesystem;

class CgroupLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("psflow_cgroup_test_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& relative, const std::string& text) {
    const fs::path path = root_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }

  fs::path root_;
};

TEST_F(CgroupLimitTest, V2TakesTheSmallestLimitOnTheWayUp) {
  Write("kubepods/pod1/ctr/memory.max", "max\n");
  Write("kubepods/pod1/memory.max", "4294967296\n");
  Write("kubepods/memory.max", "8589934592\n");
  EXPECT_EQ(internal::CgroupMemoryLimit("0::/kubepods/pod1/ctr\n", root_), int64_t{4} << 30);
  // Inside a container the path may name the host's hierarchy, which is not
  // there; the container's own root still counts.
  Write("memory.max", "1073741824\n");
  EXPECT_EQ(internal::CgroupMemoryLimit("0::/not/mounted/here\n", root_), int64_t{1} << 30);
}

TEST_F(CgroupLimitTest, V1ReadsTheMemoryControllerAndIgnoresNoLimit) {
  Write("memory/job/memory.limit_in_bytes", "9223372036854771712\n");  // v1 "no limit"
  const std::string cgroup = "4:memory:/job\n3:cpuset:/\n0::/\n";
  EXPECT_EQ(internal::CgroupMemoryLimit(cgroup, root_), 0);
  Write("memory/job/memory.limit_in_bytes", "536870912\n");
  EXPECT_EQ(internal::CgroupMemoryLimit(cgroup, root_), int64_t{512} << 20);
}

TEST_F(CgroupLimitTest, NoFilesOrGarbageMeanNoLimit) {
  EXPECT_EQ(internal::CgroupMemoryLimit("0::/a/b\n", root_), 0);
  EXPECT_EQ(internal::CgroupMemoryLimit("", root_), 0);
  EXPECT_EQ(internal::CgroupMemoryLimit("not a cgroup line\n", root_), 0);
  Write("a/memory.max", "lots\n");
  EXPECT_EQ(internal::CgroupMemoryLimit("0::/a\n", root_), 0);
}

// The CPU limit the worker's and the shard's automatic thread counts keep
// to: a Kubernetes pod's `resources.limits.cpu` of 2500m is a quota of
// 250000 us per 100000 us period.
TEST_F(CgroupLimitTest, CpuQuotaV2IsQuotaOverPeriodSmallestOnTheWayUp) {
  Write("kubepods/pod1/ctr/cpu.max", "max 100000\n");
  Write("kubepods/pod1/cpu.max", "250000 100000\n");
  Write("kubepods/cpu.max", "800000 100000\n");
  EXPECT_DOUBLE_EQ(internal::CgroupCpuLimit("0::/kubepods/pod1/ctr\n", root_), 2.5);
  EXPECT_DOUBLE_EQ(internal::CgroupCpuLimit("0::/kubepods\n", root_), 8.0);
  Write("other/cpu.max", "max 100000\n");
  EXPECT_EQ(internal::CgroupCpuLimit("0::/other\n", root_), 0.0);
}

TEST_F(CgroupLimitTest, CpuQuotaV1ReadsTheCpuControllerAndIgnoresNoLimit) {
  // The controller may share its hierarchy with cpuacct.
  const std::string cgroup = "3:cpu,cpuacct:/job\n4:memory:/job\n0::/\n";
  Write("cpu/job/cpu.cfs_quota_us", "-1\n");
  Write("cpu/job/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(internal::CgroupCpuLimit(cgroup, root_), 0.0);
  Write("cpu/job/cpu.cfs_quota_us", "50000\n");
  EXPECT_DOUBLE_EQ(internal::CgroupCpuLimit(cgroup, root_), 0.5);
  // A "cpuset" controller is not "cpu".
  EXPECT_EQ(internal::CgroupCpuLimit("3:cpuset:/job\n", root_), 0.0);
}

TEST_F(CgroupLimitTest, CpuQuotaGarbageMeansNoLimit) {
  EXPECT_EQ(internal::CgroupCpuLimit("0::/a\n", root_), 0.0);
  Write("a/cpu.max", "lots\n");
  EXPECT_EQ(internal::CgroupCpuLimit("0::/a\n", root_), 0.0);
  Write("a/cpu.max", "100000 0\n");
  EXPECT_EQ(internal::CgroupCpuLimit("0::/a\n", root_), 0.0);
}

// The cores this thread's mask allows now.
int AllowedCores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
}

// While it lives, none of the variables that make OpenMP pin its first
// thread is set (UsableCores then reads no mask); those set are put back.
class OpenMpBindingUnset {
 public:
  OpenMpBindingUnset() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      before_.push_back(value == nullptr ? std::nullopt : std::optional<std::string>(value));
      unsetenv(name);
    }
  }
  ~OpenMpBindingUnset() {
    for (size_t i = 0; i < before_.size(); ++i) {
      if (before_[i].has_value()) {
        setenv(kNames[i], before_[i]->c_str(), 1);
      } else {
        unsetenv(kNames[i]);
      }
    }
  }

 private:
  static constexpr const char* kNames[] = {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY",
                                           "KMP_AFFINITY"};
  std::vector<std::optional<std::string>> before_;
};

// What UsableCores should count here, from the mask and this process's
// cgroup quota (CgroupCpuLimit, tested above on made-up trees): on a CI
// machine without a CPU limit, its cores.
int ExpectedUsableCores() {
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  const double quota = internal::CgroupCpuLimit(text.str(), "/sys/fs/cgroup");
  int cores = AllowedCores();
  if (quota > 0) cores = std::min(cores, static_cast<int>(std::floor(quota + 1e-6)));
  return std::max(1, cores);
}

TEST(UsableCoresTest, CountsTheMaskWithinTheQuota) {
  OpenMpBindingUnset unset;
  const int cores = UsableCores();
  EXPECT_EQ(cores, ExpectedUsableCores());
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
}

// While it lives, this thread may run on the first core of its mask only
// (as under `taskset -c N`, or after a binding OpenMP runtime pinned it).
class PinnedToOneCore {
 public:
  PinnedToOneCore() {
    CPU_ZERO(&all_);
    if (sched_getaffinity(0, sizeof(all_), &all_) != 0) return;
    int first = 0;
    while (!CPU_ISSET(first, &all_)) ++first;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    pinned_ = sched_setaffinity(0, sizeof(one), &one) == 0;
  }
  ~PinnedToOneCore() {
    if (pinned_) sched_setaffinity(0, sizeof(all_), &all_);
  }
  bool pinned() const { return pinned_; }

 private:
  cpu_set_t all_;
  bool pinned_ = false;
};

// As under `taskset -c N`: one core allowed, one counted.
TEST(UsableCoresTest, KeepsToTheAffinityMask) {
  if (AllowedCores() < 2) GTEST_SKIP() << "one core allowed: a mask of one shows nothing";
  OpenMpBindingUnset unset;
  int cores = 0;
  {
    PinnedToOneCore pin;
    ASSERT_TRUE(pin.pinned());
    cores = UsableCores();
  }
  EXPECT_EQ(cores, 1);
}

// libgomp pins the first thread before main when told to bind threads; the
// mask of that thread must not make the worker think it has one core.
TEST(UsableCoresTest, OpenMpBindingLeavesThePinnedThreadsMaskAside) {
  const int allowed = AllowedCores();
  if (allowed < 2 || allowed != static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN))) {
    GTEST_SKIP() << "needs every core of the machine, at least 2, in this thread's mask";
  }
  const int full = ExpectedUsableCores();
  if (full < 2) GTEST_SKIP() << "a CPU quota of one core hides what the mask does";
  OpenMpBindingUnset unset;
  int bound = 0, not_bound = 0, placed = 0;
  {
    PinnedToOneCore pin;
    ASSERT_TRUE(pin.pinned());
    setenv("OMP_PROC_BIND", "true", 1);
    bound = UsableCores();
    setenv("OMP_PROC_BIND", "false", 1);
    not_bound = UsableCores();
    unsetenv("OMP_PROC_BIND");
    setenv("OMP_PLACES", "cores", 1);
    placed = UsableCores();
    unsetenv("OMP_PLACES");
  }
  EXPECT_EQ(bound, full);
  EXPECT_EQ(placed, full);
  EXPECT_EQ(not_bound, 1);
}

// The peak is never below the resident size read just before it (the
// kernel's high-water mark lags; a summary once said peak < current).
TEST(ResidentBytesTest, PeakIsAtLeastTheCurrentSize) {
  std::vector<char> touched(64 << 20, 1);
  const int64_t now = ResidentBytes();
  const int64_t peak = PeakResidentBytes();
  EXPECT_GT(now, int64_t{64} << 20);
  EXPECT_GE(peak, now);
  EXPECT_EQ(touched[12345], 1);
}

TEST(MemoryLimitTest, IsPositiveAndAtMostTheMachine) {
  const int64_t limit = MemoryLimitBytes();
  const int64_t machine = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  EXPECT_GT(limit, 0);
  EXPECT_LE(limit, machine);
}

}  // namespace
}  // namespace psflow
