// Ring all-reduce on point-to-point send/recv, and the algorithm switch (see ring_all_reduce.h).
#include "harness/data_parallel/ring_all_reduce.h"

#include <torch/torch.h>

#include <stdexcept>

namespace harness::data_parallel {
namespace {

// Tags of the ring's messages: one per step and tag space, so a message can only match the step
// (and the ring) it belongs to. Steps 0 .. N-2 are the scatter-reduce, N-1 .. 2N-3 the all-gather.
constexpr int kTagSpaceSize = 1 << 20;
constexpr int kMaxTagSpace = 1023;  // tags stay below 2^30

int wrap(int value, int n) { return ((value % n) + n) % n; }

// A Work completed by RingAllReduceThread; wait() is the base class's (blocks on completed_,
// rethrows the stored exception).
class RingWork : public c10d::Work {
 public:
  explicit RingWork(int rank) : c10d::Work(rank, c10d::OpType::ALLREDUCE, "ring_all_reduce") {}
  using c10d::Work::finish;
};

void check_tensor(const DistContext& ctx, const at::Tensor& tensor, ReduceKind kind,
                  const char* who) {
  TORCH_CHECK(ctx.group, who, ": the DistContext has no process group");
  TORCH_CHECK(tensor.defined(), who, ": the tensor is undefined");
  TORCH_CHECK(tensor.layout() == at::kStrided, who, ": only dense tensors, got layout ",
              tensor.layout());
  if (kind == ReduceKind::kMean) {
    TORCH_CHECK(at::isFloatingType(tensor.scalar_type()) || at::isComplexType(tensor.scalar_type()),
                who, ": a mean needs a floating-point tensor, got ", tensor.scalar_type());
  }
}

// The ring on a contiguous 1-D buffer.
void ring_on_flat(const DistContext& ctx, at::Tensor& flat, int tag_space) {
  const int n = ctx.world_size;
  const int r = ctx.rank;
  const int right = wrap(r + 1, n);
  const int left = wrap(r - 1, n);
  const int64_t numel = flat.numel();
  auto chunk = [&](int c) {
    const auto [begin, end] = ring_chunk_bounds(numel, n, c);
    return flat.slice(0, begin, end);
  };
  // The longest chunk is chunk 0; the scatter-reduce receives into this scratch space.
  const at::Tensor scratch = at::empty({ring_chunk_bounds(numel, n, 0).second}, flat.options());

  auto exchange = [&](int step, at::Tensor send_chunk, at::Tensor recv_into) {
    try {
      ring_exchange(ctx.group, send_chunk, recv_into, tag_space * kTagSpaceSize + step);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw std::runtime_error("ring_all_reduce: rank " + std::to_string(r) + " of " +
                               std::to_string(n) + ", step " + std::to_string(step) +
                               " (sending " + std::to_string(send_chunk.numel()) +
                               " elements to rank " + std::to_string(right) + ", receiving " +
                               std::to_string(recv_into.numel()) + " from rank " +
                               std::to_string(left) + "): " + what.substr(0, what.find('\n')));
    }
  };

  for (int s = 0; s < n - 1; ++s) {
    const int send_c = wrap(r - s, n);
    const int recv_c = wrap(r - s - 1, n);
    at::Tensor target = chunk(recv_c);
    at::Tensor incoming = scratch.slice(0, 0, target.numel());
    exchange(s, chunk(send_c), incoming);
    target.add_(incoming);
  }
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = wrap(r + 1 - s, n);
    const int recv_c = wrap(r - s, n);
    exchange(n - 1 + s, chunk(send_c), chunk(recv_c));
  }
}

}  // namespace

void ring_exchange(const c10::intrusive_ptr<c10d::Backend>& group, const at::Tensor& to_next,
                   const at::Tensor& from_previous, int tag) {
  const int n = group->getSize(), r = group->getRank();
  std::vector<at::Tensor> send_tensors{to_next}, recv_tensors{from_previous};
  c10::intrusive_ptr<c10d::Work> sent, received;
  const bool receive_first = r % 2 == 1;
  if (receive_first && from_previous.numel() > 0) received = group->recv(recv_tensors, wrap(r - 1, n), tag);
  if (to_next.numel() > 0) sent = group->send(send_tensors, wrap(r + 1, n), tag);
  if (!receive_first && from_previous.numel() > 0) received = group->recv(recv_tensors, wrap(r - 1, n), tag);
  if (sent) sent->wait();
  if (received) received->wait();
}

AllReduceAlgorithm parse_allreduce_algorithm(const std::string& name) {
  if (name == "builtin") return AllReduceAlgorithm::kBuiltin;
  if (name == "ring") return AllReduceAlgorithm::kRing;
  throw std::invalid_argument("--allreduce " + name + " is unknown: use builtin or ring");
}

std::string to_string(AllReduceAlgorithm algorithm) {
  return algorithm == AllReduceAlgorithm::kRing ? "ring" : "builtin";
}

std::pair<int64_t, int64_t> ring_chunk_bounds(int64_t numel, int world_size, int chunk) {
  if (world_size < 1 || chunk < 0 || chunk >= world_size || numel < 0) {
    throw std::invalid_argument("ring_chunk_bounds: chunk " + std::to_string(chunk) +
                                " of a tensor of " + std::to_string(numel) +
                                " elements over " + std::to_string(world_size) + " ranks");
  }
  const int64_t base = numel / world_size;
  const int64_t longer = numel % world_size;  // the first `longer` chunks get one more
  const int64_t begin = chunk * base + std::min<int64_t>(chunk, longer);
  return {begin, begin + base + (chunk < longer ? 1 : 0)};
}

void ring_all_reduce(const DistContext& ctx, at::Tensor& tensor, ReduceKind kind, int tag_space) {
  check_tensor(ctx, tensor, kind, "ring_all_reduce");
  TORCH_CHECK(tag_space >= 0 && tag_space <= kMaxTagSpace, "ring_all_reduce: tag_space ", tag_space,
              " is outside [0, ", kMaxTagSpace, "]");
  TORCH_CHECK(2 * ctx.world_size < kTagSpaceSize, "ring_all_reduce: world size ", ctx.world_size,
              " is too large for the ring's tags");
  at::NoGradGuard no_grad;
  if (ctx.world_size > 1 && tensor.numel() > 0) {
    const bool contiguous = tensor.is_contiguous();
    at::Tensor buffer = contiguous ? tensor : tensor.contiguous();
    at::Tensor flat = buffer.view({-1});
    ring_on_flat(ctx, flat, tag_space);
    if (!contiguous) tensor.copy_(buffer);
  }
  if (kind == ReduceKind::kMean) tensor.div_(static_cast<double>(ctx.world_size));
}

void builtin_all_reduce(const DistContext& ctx, at::Tensor& tensor, ReduceKind kind) {
  check_tensor(ctx, tensor, kind, "builtin_all_reduce");
  all_reduce_sum(ctx, tensor);
  if (kind == ReduceKind::kMean) {
    at::NoGradGuard no_grad;
    tensor.div_(static_cast<double>(ctx.world_size));
  }
}

void all_reduce(const DistContext& ctx, at::Tensor& tensor, AllReduceAlgorithm algorithm,
                ReduceKind kind) {
  if (algorithm == AllReduceAlgorithm::kRing) {
    ring_all_reduce(ctx, tensor, kind);
  } else {
    builtin_all_reduce(ctx, tensor, kind);
  }
}

RingAllReduceThread::RingAllReduceThread(DistContext ctx)
    : ctx_(std::move(ctx)), thread_([this] { loop(); }) {}

RingAllReduceThread::~RingAllReduceThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

c10::intrusive_ptr<c10d::Work> RingAllReduceThread::all_reduce_async(at::Tensor tensor,
                                                                     ReduceKind kind) {
  auto work = c10::make_intrusive<RingWork>(ctx_.rank);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "RingAllReduceThread: submitted while shutting down");
    queue_.push_back([this, work, tensor, kind]() mutable {
      try {
        ring_all_reduce(ctx_, tensor, kind, kRingThreadTagSpace);
        work->finish();
      } catch (...) {
        work->finish(std::current_exception());
      }
    });
  }
  wake_.notify_one();
  return work;
}

void RingAllReduceThread::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace harness::data_parallel
