// c10d point-to-point transport for pipeline stages that are processes (see process_transport.h).
#include "harness/pipeline/process_transport.h"

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace harness::pipeline {
namespace {

std::tuple<int, int, int> key_of(const P2PMessage& m) {
  return {static_cast<int>(m.kind), m.micro_batch, m.from_stage};
}

std::string sizes_text(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

}  // namespace

int p2p_tag(const P2PMessage& message) {
  // Stages and micro-batches stay far below these bounds (S <= 1024 stages, M < 2^20).
  return ((message.from_stage << 1) | (message.kind == P2PMessage::Kind::kGradient ? 1 : 0)) << 20 |
         message.micro_batch;
}

ProcessTransport::ProcessTransport(c10::intrusive_ptr<c10d::Backend> group, Device device, MessageShape shape_of,
                                   at::ScalarType dtype, std::optional<P2PDebugRecord> debug)
    : group_(std::move(group)), device_(device), shape_of_(std::move(shape_of)), dtype_(dtype),
      debug_(std::move(debug)) {
  if (!group_) throw std::invalid_argument("ProcessTransport: no pipeline group given");
  if (!shape_of_) throw std::invalid_argument("ProcessTransport: no message shape given");
}

std::string ProcessTransport::last_posted_by(int peer) const {
  const std::string key = debug_->prefix + std::to_string(peer);
  try {
    if (!debug_->store->check({key})) return "pipeline rank " + std::to_string(peer) + " had posted no exchange";
    const std::vector<uint8_t> value = debug_->store->get(key);
    return "pipeline rank " + std::to_string(peer) + " last posted " + std::string(value.begin(), value.end());
  } catch (const std::exception& e) {
    return "pipeline rank " + std::to_string(peer) + "'s record could not be read (" + e.what() + ")";
  }
}

void ProcessTransport::exchange(int device, const std::vector<P2POp>& ops,
                                const std::function<at::Tensor(const P2PMessage&)>& outgoing) {
  const int64_t number = exchanges_++;
  if (debug_) {
    const std::string text = "exchange #" + std::to_string(number) + " " + p2p_exchange_label(ops);
    debug_->store->set(debug_->prefix + std::to_string(device), std::vector<uint8_t>(text.begin(), text.end()));
  }
  // Each op's tensor list outlives its work: c10d holds references, not copies.
  std::vector<std::vector<at::Tensor>> buffers;
  buffers.reserve(ops.size());
  std::vector<std::pair<const P2POp*, size_t>> receives;
  const bool nccl = group_->getBackendName() == "nccl";
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (nccl) group_->startCoalescing();
  for (const P2POp& op : ops) {
    const std::vector<int64_t> sizes = shape_of_(op.message);
    if (op.kind == P2POp::Kind::kSend) {
      at::Tensor t = outgoing(op.message);
      if (t.sizes() != at::IntArrayRef(sizes) || t.scalar_type() != dtype_) {
        throw std::runtime_error("pipeline send " + p2p_op_label(op) + ": the tensor is " + sizes_text(t.sizes()) +
                                 " " + std::string(c10::toString(t.scalar_type())) + ", the receiver expects " +
                                 sizes_text(sizes) + " " + c10::toString(dtype_));
      }
      buffers.push_back({t.to(device_.torch_device()).contiguous()});
      sent_bytes_ += static_cast<int64_t>(t.nbytes());
      works.push_back(group_->send(buffers.back(), op.peer, p2p_tag(op.message)));
    } else {
      buffers.push_back({at::empty(sizes, at::TensorOptions().dtype(dtype_).device(device_.torch_device()))});
      receives.emplace_back(&op, buffers.size() - 1);
      works.push_back(group_->recv(buffers.back(), op.peer, p2p_tag(op.message)));
    }
  }
  if (nccl) {
    // The coalesced group's one work stands for all of its ops.
    c10::intrusive_ptr<c10d::Work> group_work = group_->endCoalescing();
    if (group_work) works = {group_work};
  }
  for (size_t k = 0; k < works.size(); ++k) {
    if (!works[k]) continue;
    try {
      works[k]->wait();
    } catch (const std::exception& e) {
      std::vector<int> peers;
      for (const P2POp& op : ops) {
        if (std::find(peers.begin(), peers.end(), op.peer) == peers.end()) peers.push_back(op.peer);
      }
      std::string names, records;
      for (int peer : peers) {
        names += (names.empty() ? "" : ", ") + std::to_string(peer);
        if (debug_) records += "; " + last_posted_by(peer);
      }
      const std::string what = e.what();
      throw std::runtime_error("pipeline rank " + std::to_string(device) + " got no answer from pipeline rank " +
                               names + " in its exchange #" + std::to_string(number) + ": " +
                               what.substr(0, what.find('\n')) + records);
    }
  }
  for (const auto& [op, index] : receives) received_[key_of(op->message)] = buffers[index].front();
}

at::Tensor ProcessTransport::take(int device, const P2PMessage& message) {
  auto it = received_.find(key_of(message));
  if (it == received_.end()) {
    throw std::logic_error("pipeline rank " + std::to_string(device) + " needs " + p2p_message_label(message) +
                           " before its plan received it");
  }
  at::Tensor t = std::move(it->second);
  received_.erase(it);
  return t;
}

}  // namespace harness::pipeline
