// The metrics log (see metrics_log.h).
#include "harness/train/run/metrics_log.h"

#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include <sstream>
#include <stdexcept>
#include <vector>

#include "harness/train/run/tensorboard_writer.h"

#ifdef HARNESS_WITH_NCCL  // set whenever this LibTorch has CUDA (see CMakeLists.txt)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace harness::train {

namespace {

using ordered_json = nlohmann::ordered_json;  // the fields in the documented order

// The lines of `path` whose "step" is at most `last_step` (none when the file does not exist).
std::vector<std::string> records_through(const std::string& path, int64_t last_step) {
  std::vector<std::string> kept;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    ordered_json record;
    try {
      record = ordered_json::parse(line);
    } catch (const ordered_json::exception&) {
      continue;  // a line cut short by a kill
    }
    if (record.value("step", int64_t{0}) <= last_step) kept.push_back(line);
  }
  return kept;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, int64_t resumed_step, const std::string& tensorboard_dir)
    : path_(path) {
  const std::vector<std::string> kept = resumed_step < 0 ? std::vector<std::string>{} : records_through(path, resumed_step);
  out_.open(path, std::ios::out | std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot write the metrics log " + path);
  for (const std::string& line : kept) out_ << line << '\n';
  out_.flush();
  if (!tensorboard_dir.empty()) tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir, resumed_step);
}

MetricsLog::~MetricsLog() = default;

void MetricsLog::log(const StepMetrics& m) {
  const ordered_json record = {{"kind", "train"},
                       {"step", m.step},
                       {"epoch", m.epoch},
                       {"loss", m.loss},
                       {"learning_rate", m.learning_rate},
                       {"grad_norm", m.grad_norm},
                       {"tokens", m.tokens},
                       {"tokens_per_sec", m.tokens_per_sec},
                       {"step_time", m.step_time},
                       {"peak_memory_bytes", m.peak_memory_bytes}};
  out_ << record.dump() << std::endl;
  if (tensorboard_) {
    for (const auto& [field, value] : record.items()) {
      if (value.is_number() && field != "step") tensorboard_->add_scalar("train/" + field, value.get<double>(), m.step);
    }
  }
}

void MetricsLog::log(const EvalMetrics& m) {
  const ordered_json record = {{"kind", "eval"}, {"step", m.step}, {"epoch", m.epoch}, {"validation_loss", m.validation_loss}};
  out_ << record.dump() << std::endl;
  if (tensorboard_) tensorboard_->add_scalar("eval/validation_loss", m.validation_loss, m.step);
}

void MetricsLog::log(const MembershipRecord& m) {
  const ordered_json record = {{"kind", "membership"}, {"generation", m.generation}, {"step", m.step},
                               {"replicas", m.replicas},  {"lost", m.lost},           {"joined", m.joined}};
  out_ << record.dump() << std::endl;
  if (tensorboard_) tensorboard_->add_scalar("membership/replicas", m.replicas, m.step);
}

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef HARNESS_WITH_NCCL
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  (void)device;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // kilobytes on Linux
}

}  // namespace harness::train
