// The embedded corpus: lower-case German sentences from a small grammar (gender and case,
// adjective agreement, plurals, verb second, verb-final with modals and the perfect, separable
// verbs, numbers, times, places) with one deterministic English translation each.
#pragma once

#include <cstdint>

#include "harness/data/dataset.h"
#include "harness/data/example.h"

namespace harness::data {

// Deterministic in `seed` on every platform (own PRNG and sampling code). No German or English
// sentence occurs twice, within or across splits. German sentences have 4-12 words before " .".
TranslationCorpus generate_corpus(uint64_t seed, const SplitSizes& sizes = {});

}  // namespace harness::data
