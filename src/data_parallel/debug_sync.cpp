// DebugSyncBackend (see debug_sync.h). Rank r publishes "<seq>/<r>" under the group's store,
// waits for "<seq>/0".."<seq>/<n-1>", and compares. Once every rank's fingerprint of collective s
// is there, every rank has finished comparing s - 1, so each deletes its own key of s - 1.
#include "harness/data_parallel/debug_sync.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <sstream>
#include <stdexcept>

namespace harness::data_parallel {
namespace {

std::string reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "op " + std::to_string(static_cast<int>(op.op_));
  }
}

std::string root_detail(int64_t root) { return "root " + std::to_string(root); }

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

}  // namespace

std::string collective_fingerprint(uint64_t sequence, const std::string& op, const std::string& detail,
                                   const std::vector<at::Tensor>& tensors) {
  std::ostringstream out;
  out << '#' << sequence << ' ' << op;
  if (!detail.empty()) out << '(' << detail << ')';
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) {
      out << " undefined";
      continue;
    }
    out << ' ' << c10::getDtypeNames(t.scalar_type()).first << '[';
    for (int64_t d = 0; d < t.dim(); ++d) out << (d ? "," : "") << t.size(d);
    out << ']';
  }
  return out.str();
}

DebugSyncBackend::DebugSyncBackend(c10::intrusive_ptr<c10d::Backend> inner,
                                   c10::intrusive_ptr<c10d::Store> store, std::string group_name,
                                   std::chrono::milliseconds timeout)
    : c10d::Backend(inner->getRank(), inner->getSize()),
      inner_(std::move(inner)),
      store_(c10::make_intrusive<c10d::PrefixStore>("harness/debug_sync/", std::move(store))),
      group_name_(std::move(group_name)),
      timeout_(timeout) {
  setBoundDeviceId(inner_->getBoundDeviceId());
}

void DebugSyncBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
  inner_->setTimeout(timeout);
}

uint64_t DebugSyncBackend::checked() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sequence_;
}

void DebugSyncBackend::check(const std::string& op, const std::string& detail,
                             const std::vector<at::Tensor>& tensors) {
  const uint64_t seq = sequence_;
  const std::string mine = collective_fingerprint(seq, op, detail, tensors);
  const std::string base = std::to_string(seq) + "/";
  std::vector<std::string> keys;
  for (int r = 0; r < getSize(); ++r) keys.push_back(base + std::to_string(r));
  store_->set(keys[getRank()], std::vector<uint8_t>(mine.begin(), mine.end()));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception& e) {
    // Which ranks never posted this collective, if the store still answers.
    std::vector<int> missing;
    bool store_answers = true;
    try {
      for (int r = 0; r < getSize(); ++r) {
        if (r != getRank() && !store_->check({keys[r]})) missing.push_back(r);
      }
    } catch (const std::exception&) {
      store_answers = false;
    }
    const std::string what = e.what();
    std::ostringstream msg;
    msg << "--debug_sync: rank " << getRank() << " of " << group_name_ << " waited before collective " << mine;
    if (store_answers && !missing.empty()) {
      msg << " for rank" << (missing.size() == 1 ? " " : "s ");
      for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
      msg << ", which never reached it within " << timeout_.count() / 1000.0
          << " s (stuck, dead, or issuing fewer collectives)";
    } else {
      msg << " and the store " << (store_answers ? "" : "(rank 0's) stopped answering: ")
          << what.substr(0, what.find('\n'));
    }
    throw std::runtime_error(msg.str());
  }
  const std::vector<std::vector<uint8_t>> views = store_->multiGet(keys);
  bool same = true;
  for (const auto& view : views) same = same && text_of(view) == mine;
  if (!same) {
    std::ostringstream msg;
    msg << "--debug_sync: the ranks of " << group_name_ << " issue different collectives at #"
        << seq << " (they would hang or reduce mismatched buffers):";
    for (int r = 0; r < getSize(); ++r) msg << " rank " << r << ": " << text_of(views[r]) << ";";
    throw std::runtime_error(msg.str());
  }
  if (seq > 0) store_->deleteKey(std::to_string(seq - 1) + "/" + std::to_string(getRank()));
  ++sequence_;
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("broadcast", root_detail(opts.rootRank), tensors);
  return inner_->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allreduce", reduce_op_name(opts.reduceOp), tensors);
  return inner_->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allreduce_coalesced", reduce_op_name(opts.reduceOp), tensors);
  return inner_->allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("reduce", reduce_op_name(opts.reduceOp) + ", " + root_detail(opts.rootRank), tensors);
  return inner_->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allgather", "", concat(inputs, flatten(outputs)));
  return inner_->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allgather_into_tensor", "", {input, output});
  return inner_->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allgather_into_tensor_coalesced", "", concat(inputs, outputs));
  return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
}

// Gather and scatter: only the root holds the list side, so only the per-rank side is compared.
c10::intrusive_ptr<c10d::Work> DebugSyncBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("gather", root_detail(opts.rootRank), inputs);
  return inner_->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("scatter", root_detail(opts.rootRank), outputs);
  return inner_->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("reduce_scatter", reduce_op_name(opts.reduceOp), concat(outputs, flatten(inputs)));
  return inner_->reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("reduce_scatter_tensor", reduce_op_name(opts.reduceOp), {output, input});
  return inner_->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("reduce_scatter_tensor_coalesced", reduce_op_name(opts.reduceOp), concat(outputs, inputs));
  return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& output_splits,
                                                               std::vector<int64_t>& input_splits,
                                                               const c10d::AllToAllOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Split sizes differ by rank by design; the buffers' dtype and rank count are what must agree.
  check("alltoall_base", "", {input.flatten().narrow(0, 0, 0), output.flatten().narrow(0, 0, 0)});
  return inner_->alltoall_base(output, input, output_splits, input_splits, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("alltoall", "", {});
  return inner_->alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::barrier(const c10d::BarrierOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("barrier", "", {});
  return inner_->barrier(opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allgather_coalesced", "", concat(inputs, flatten(outputs)));
  return inner_->allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  check("allreduce_sparse", reduce_op_name(opts.reduceOp), tensors);
  return inner_->allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return inner_->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return inner_->recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> DebugSyncBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return inner_->recvAnysource(tensors, tag);
}

}  // namespace harness::data_parallel
