// All-reduce as a choice of algorithm: c10d's built-in collective, or a ring all-reduce written on
// the group's point-to-point send/recv (N-1 scatter-reduce steps, then N-1 all-gather steps), the
// algorithm NCCL and Horovod made standard because each rank sends 2(N-1)/N of the data whatever N.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness/data_parallel/process_group.h"

namespace harness::data_parallel {

// --allreduce: builtin (the process group's allreduce) or ring (ring_all_reduce below).
enum class AllReduceAlgorithm { kBuiltin, kRing };
enum class ReduceKind { kSum, kMean };

// "builtin" / "ring"; anything else throws std::invalid_argument naming --allreduce.
AllReduceAlgorithm parse_allreduce_algorithm(const std::string& name);
std::string to_string(AllReduceAlgorithm algorithm);

// Chunk c of a length-`numel` tensor split over `world_size` ranks: [begin, end). The first
// numel % world_size chunks are one element longer; with numel < world_size some are empty.
std::pair<int64_t, int64_t> ring_chunk_bounds(int64_t numel, int world_size, int chunk);

// One step of a ring over `group`'s send/recv: `to_next` goes to rank + 1 and `from_previous` is
// filled by rank - 1, both with `tag`; an empty tensor is neither sent nor received (both sides
// know every length). Odd ranks receive first and even ranks send first, which breaks every cycle
// of waits where a backend serialises a pair's operations (NCCL with two ranks, where
// left == right). Blocks until both are done. Both tensors contiguous.
void ring_exchange(const c10::intrusive_ptr<c10d::Backend>& group, const at::Tensor& to_next,
                   const at::Tensor& from_previous, int tag);

// In-place ring all-reduce of one dense tensor (any shape; a non-contiguous one goes through a
// contiguous buffer). Step s of the scatter-reduce: rank r sends chunk (r - s) mod N to rank
// r + 1 and adds the chunk (r - s - 1) mod N it receives from rank r - 1; after N - 1 steps rank r
// holds the full sum of chunk (r + 1) mod N. The all-gather passes the finished chunks around the
// ring N - 1 more times, each received chunk replacing the local one, so every rank ends with
// bit-identical values. kMean divides by the world size afterwards (floating dtypes only).
// Every rank must call it with the same numel and dtype, in the same order. Messages carry tags
// from `tag_space` (0 .. 1023): rings that may run at the same time on one group (another thread)
// must use different tag spaces; RingAllReduceThread uses kRingThreadTagSpace. Blocks until done;
// errors (std::runtime_error / c10 errors) name the rank, step and peer.
constexpr int kRingThreadTagSpace = 1;
void ring_all_reduce(const DistContext& ctx, at::Tensor& tensor, ReduceKind kind = ReduceKind::kSum,
                     int tag_space = 0);

// The same through the process group's own allreduce (SUM, then division for kMean).
void builtin_all_reduce(const DistContext& ctx, at::Tensor& tensor,
                        ReduceKind kind = ReduceKind::kSum);

// Dispatches on `algorithm`.
void all_reduce(const DistContext& ctx, at::Tensor& tensor, AllReduceAlgorithm algorithm,
                ReduceKind kind = ReduceKind::kSum);

// Runs ring all-reduces asynchronously, strictly one after the other in submission order, on a
// dedicated communication thread it owns (joined in the destructor after the queue drains), so
// that a caller can overlap them with computation as it would a c10d collective. Every rank must
// submit the same sequence. The returned Work's wait() rethrows a failure of that all-reduce.
// Its messages use tag space kRingThreadTagSpace, so a ring_all_reduce on the caller's thread
// (tag space 0) may run meanwhile; two such threads on one group at once may not.
class RingAllReduceThread {
 public:
  explicit RingAllReduceThread(DistContext ctx);
  ~RingAllReduceThread();
  RingAllReduceThread(const RingAllReduceThread&) = delete;
  RingAllReduceThread& operator=(const RingAllReduceThread&) = delete;

  // `tensor` must stay alive and untouched until the Work completes.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor tensor, ReduceKind kind);

 private:
  void loop();

  DistContext ctx_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace harness::data_parallel
