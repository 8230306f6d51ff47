// Worker threads for the pipeline.
#include "harness/pipeline/worker.h"

#include <torch/torch.h>

#include <stdexcept>

namespace harness::pipeline {
namespace {

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace

Worker::Worker(Device device, int intra_op_threads) : device_(device) {
  std::promise<void> started;
  std::future<void> started_future = started.get_future();
  thread_ = std::thread(&Worker::loop, this, intra_op_threads, &started);
  try {
    started_future.get();
  } catch (const std::exception& e) {
    thread_.join();  // the loop returns right after a failed start
    throw std::runtime_error("worker for " + device_.str() + " could not start: " + message_of(e));
  }
}

Worker::~Worker() {
  in_.push(Job{});
  thread_.join();
}

void Worker::loop(int intra_op_threads, std::promise<void>* started) {
  try {
    enter_device_lane(device_, intra_op_threads);
  } catch (...) {
    started->set_exception(std::current_exception());
    return;
  }
  started->set_value();
  for (;;) {
    Job job = in_.pop();
    if (!job.work) return;
    std::exception_ptr error;
    try {
      torch::AutoGradMode grad_mode(job.grad_mode);
      job.work();
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          std::runtime_error(job.what + " on " + device_.str() + " failed: " + message_of(e)));
    } catch (...) {
      error = std::make_exception_ptr(
          std::runtime_error(job.what + " on " + device_.str() + " failed with a non-standard exception"));
    }
    out_.push(error);
  }
}

void Worker::submit(std::function<void()> work, std::string what) {
  TORCH_CHECK(static_cast<bool>(work), "Worker::submit(", what, "): empty task");
  in_.push(Job{std::move(work), torch::GradMode::is_enabled(), std::move(what)});
}

std::exception_ptr Worker::take() { return out_.pop(); }

Workers::Workers(const std::vector<Device>& devices, int intra_op_threads) {
  // Each worker's at::set_num_threads also changes the width ATen gives threads it initialises
  // later; initialise the calling thread now so it keeps its own width.
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
  for (const Device& device : devices) {
    if (workers_.count(device) == 0) {
      workers_.emplace(device, std::make_unique<Worker>(device, intra_op_threads));
    }
  }
}

Worker& Workers::at(const Device& device) {
  auto it = workers_.find(device);
  if (it == workers_.end()) throw std::out_of_range("no pipeline worker for device " + device.str());
  return *it->second;
}

void run_concurrently(std::vector<WorkerTask> tasks) {
  for (WorkerTask& task : tasks) task.worker->submit(std::move(task.work), task.what);
  std::exception_ptr first;
  for (WorkerTask& task : tasks) {
    std::exception_ptr error = task.worker->take();
    if (error && !first) first = error;
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace harness::pipeline
