// GPipe's step as two of the engine's plans, its forwards and its backwards, for the Pipe: its
// forward runs the first now and the autograd engine (or, pipelined, the second) runs the backward
// later. Run in unit time the halves are exactly the clock of clock_cycles and
// backward_clock_cycles (schedule.h), which unit_time_cycles shows and the tests check.
#pragma once

#include <vector>

#include "harness/pipeline/p2p_plan.h"
#include "harness/pipeline/schedule.h"

namespace harness::pipeline {

struct PlanHalves {
  P2PPlan forward;   // every forward action and the activations' sends and receives
  P2PPlan backward;  // every backward action and the gradients' sends and receives
};

// Splits `plan` where each device's backwards begin: each compute action goes to its half, each
// exchange group's ops to the half of their message (an activation's or a gradient's), groups left
// empty are dropped; each half's schedule keeps its own actions. For m = 2 micro-batches over
// n = 2 partitions (make_p2p_plan(gpipe_schedule(2, 2))):
//   forward   device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1]
//             device 1: [recv act 0 s0->s1 from 0] F0 [recv act 1 s0->s1 from 0] F1
//   backward  device 0: [recv grad 1 s1->s0 from 1] B1 [recv grad 0 s1->s0 from 1] B0
//             device 1: B1 [send grad 1 s1->s0 to 0] B0 [send grad 0 s1->s0 to 0]
// Throws std::invalid_argument, naming the schedule, device and action, when a device runs a
// forward after one of its backwards (1F1B's steady state), which no split can run apart.
PlanHalves split_at_first_backward(const P2PPlan& plan);

// The halves of GPipe over m micro-batches and n partitions, one device (lane) per partition:
// split_at_first_backward(make_p2p_plan(gpipe_schedule(m, n))), each half checked with
// validate_p2p_plan. Made once per (m, n) and kept. Throws std::invalid_argument unless m, n >= 1.
const PlanHalves& gpipe_plan_halves(int m, int n);

// The clock `plan` runs in unit time, as clock_cycles writes it: every task takes one tick and a
// device starts its next one in the tick after that task's inputs are made (forward (i, j) after
// forward (i, j - 1); backward (i, j) after backward (i, j + 1) and its own forward, where those
// are in the plan). Cycle k lists the (micro-batch, stage) tasks run at tick k, forwards with the
// micro-batch descending, then backwards with it ascending, the order of clock_cycles and
// backward_clock_cycles. Throws std::invalid_argument when the plan's devices wait for each other.
std::vector<Cycle> unit_time_cycles(const P2PPlan& plan);

}  // namespace harness::pipeline
