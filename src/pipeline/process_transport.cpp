// c10d point-to-point transport for pipeline stages that are processes (see process_transport.h).
#include "harness/pipeline/process_transport.h"

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace harness::pipeline {
namespace {

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
  const std::string label = p2p_exchange_label(ops);
  if (debug_) {
    const std::string text = "exchange #" + std::to_string(number) + " " + label;
    debug_->store->set(debug_->prefix + std::to_string(device), std::vector<uint8_t>(text.begin(), text.end()));
  }
  // Sends that completed while this stage computed need no wait at the end.
  sending_.erase(std::remove_if(sending_.begin(), sending_.end(),
                                [](const Posted& p) { return !p.work || p.work->isCompleted(); }),
                 sending_.end());
  std::vector<int> peers;
  for (const P2POp& op : ops) {
    if (std::find(peers.begin(), peers.end(), op.peer) == peers.end()) peers.push_back(op.peer);
  }
  const bool nccl = group_->getBackendName() == "nccl";
  // Each op's tensor outlives its work: c10d holds references, not copies.
  std::vector<Posted> posted;
  posted.reserve(ops.size());
  if (nccl) group_->startCoalescing();
  for (const P2POp& op : ops) {
    const std::vector<int64_t> sizes = shape_of_(op.message);
    Posted p;
    p.exchange = number;
    p.exchange_label = label;
    p.peers = peers;
    if (op.kind == P2POp::Kind::kSend) {
      at::Tensor t = outgoing(op.message);
      if (t.sizes() != at::IntArrayRef(sizes) || t.scalar_type() != dtype_) {
        throw std::runtime_error("pipeline send " + p2p_op_label(op) + ": the tensor is " + sizes_text(t.sizes()) +
                                 " " + std::string(c10::toString(t.scalar_type())) + ", the receiver expects " +
                                 sizes_text(sizes) + " " + c10::toString(dtype_));
      }
      std::vector<at::Tensor> tensors{t.to(device_.torch_device()).contiguous()};
      sent_bytes_ += static_cast<int64_t>(t.nbytes());
      p.work = group_->send(tensors, op.peer, p2p_tag(op.message));
      p.tensor = tensors.front();
    } else {
      std::vector<at::Tensor> tensors{at::empty(sizes, at::TensorOptions().dtype(dtype_).device(device_.torch_device()))};
      p.work = group_->recv(tensors, op.peer, p2p_tag(op.message));
      p.tensor = tensors.front();
    }
    posted.push_back(std::move(p));
  }
  if (nccl) {
    // The coalesced group's one work stands for all of its ops; waiting for it only orders the
    // device's stream after the group, so it is waited for here.
    c10::intrusive_ptr<c10d::Work> group_work = group_->endCoalescing();
    if (group_work) {
      for (Posted& p : posted) p.work.reset();
      posted.front().work = group_work;
    }
    for (Posted& p : posted) wait_for(p, device);
  }
  for (size_t k = 0; k < ops.size(); ++k) {
    if (ops[k].kind == P2POp::Kind::kSend) {
      if (posted[k].work) sending_.push_back(std::move(posted[k]));
    } else {
      received_[ops[k].message] = std::move(posted[k]);
    }
  }
}

void ProcessTransport::wait_for(Posted& posted, int device) {
  if (!posted.work) return;
  c10::intrusive_ptr<c10d::Work> work = std::move(posted.work);
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string names, records;
    for (int peer : posted.peers) {
      names += (names.empty() ? "" : ", ") + std::to_string(peer);
      if (debug_) records += "; " + last_posted_by(peer);
    }
    const std::string what = e.what();
    throw std::runtime_error("pipeline rank " + std::to_string(device) + " got no answer from pipeline rank " +
                             names + " in its exchange #" + std::to_string(posted.exchange) + " " +
                             posted.exchange_label + ": " + what.substr(0, what.find('\n')) + records);
  }
}

at::Tensor ProcessTransport::take(int device, const P2PMessage& message) {
  auto it = received_.find(message);
  if (it == received_.end()) {
    throw std::logic_error("pipeline rank " + std::to_string(device) + " needs " + p2p_message_label(message) +
                           " before its plan received it");
  }
  Posted posted = std::move(it->second);
  received_.erase(it);
  wait_for(posted, device);
  return posted.tensor;
}

void ProcessTransport::finish(int device) {
  std::vector<Posted> sending = std::move(sending_);
  sending_.clear();
  for (Posted& p : sending) wait_for(p, device);
}

}  // namespace harness::pipeline
