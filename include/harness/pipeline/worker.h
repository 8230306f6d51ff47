// Per-device worker threads: each has an input queue of closures and an output queue of their
// outcomes. A worker is owned by one object and joined when that object is destroyed (a poison
// pill ends its loop), so no thread outlives the pipe that made it, even after a failure.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "harness/device.h"

namespace harness::pipeline {

// An unbounded blocking FIFO.
template <typename T>
class BlockingQueue {
 public:
  void push(T item) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items_.push_back(std::move(item));
    }
    ready_.notify_one();
  }
  T pop() {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [this] { return !items_.empty(); });
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<T> items_;
};

class Worker {
 public:
  // Starts the thread, which enters `device`'s lane (intra-op threads, current GPU) first.
  // Throws, naming the device, when that fails.
  Worker(Device device, int intra_op_threads);
  ~Worker();  // queues the poison pill after any pending task and joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  const Device& device() const { return device_; }

  // Queues `work`, to run on this worker's thread under the grad mode of the calling thread.
  // `what` names the task ("forward of micro-batch 2, partition 1") in error messages.
  void submit(std::function<void()> work, std::string what);

  // Waits for the oldest task not yet taken. Returns nullptr when it succeeded, else a
  // std::runtime_error "<what> on <device> failed: <message>".
  std::exception_ptr take();

 private:
  struct Job {
    std::function<void()> work;  // empty: the poison pill
    bool grad_mode = false;
    std::string what;
  };
  void loop(int intra_op_threads, std::promise<void>* started);

  Device device_;
  BlockingQueue<Job> in_;
  BlockingQueue<std::exception_ptr> out_;
  std::thread thread_;
};

// One Worker per distinct device of `devices`, all with `intra_op_threads` threads.
class Workers {
 public:
  Workers(const std::vector<Device>& devices, int intra_op_threads);
  Worker& at(const Device& device);
  size_t size() const { return workers_.size(); }

 private:
  std::map<Device, std::unique_ptr<Worker>> workers_;
};

struct WorkerTask {
  Worker* worker;
  std::function<void()> work;
  std::string what;
};

// Submits every task, waits for all of them (also after a failure, so no task still runs when
// this returns), then rethrows the first failure in submission order.
void run_concurrently(std::vector<WorkerTask> tasks);

}  // namespace harness::pipeline
