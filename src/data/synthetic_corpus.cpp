// A small German grammar with its English translation, sampled with splitmix64 so that the
// corpus is the same on every platform (no std:: distributions, whose output is
// implementation-defined).
#include "harness/data/synthetic_corpus.h"

#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace harness::data {
namespace {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
  // True with probability percent / 100.
  bool chance(unsigned percent) { return below(100) < percent; }
  template <typename T>
  const T& pick(const std::vector<T>& items) { return items[below(items.size())]; }

 private:
  uint64_t state_;
};

enum Gender { kMasculine = 0, kFeminine = 1, kNeuter = 2 };
enum Case { kNominative = 0, kAccusative = 1 };

struct Noun {
  std::string de_singular, de_plural;
  Gender gender;
  std::string en_singular, en_plural;
};

// Animate nouns can be subjects and objects; things only objects.
const std::vector<Noun> kPeople = {
    {"mann", "männer", kMasculine, "man", "men"},
    {"lehrer", "lehrer", kMasculine, "teacher", "teachers"},
    {"frau", "frauen", kFeminine, "woman", "women"},
    {"kind", "kinder", kNeuter, "child", "children"},
};
const std::vector<Noun> kAnimals = {
    {"hund", "hunde", kMasculine, "dog", "dogs"},
    {"vogel", "vögel", kMasculine, "bird", "birds"},
    {"katze", "katzen", kFeminine, "cat", "cats"},
    {"pferd", "pferde", kNeuter, "horse", "horses"},
};
const std::vector<Noun> kThings = {
    {"ball", "bälle", kMasculine, "ball", "balls"},
    {"apfel", "äpfel", kMasculine, "apple", "apples"},
    {"brief", "briefe", kMasculine, "letter", "letters"},
    {"blume", "blumen", kFeminine, "flower", "flowers"},
    {"tasche", "taschen", kFeminine, "bag", "bags"},
    {"zeitung", "zeitungen", kFeminine, "newspaper", "newspapers"},
    {"buch", "bücher", kNeuter, "book", "books"},
    {"auto", "autos", kNeuter, "car", "cars"},
    {"bild", "bilder", kNeuter, "picture", "pictures"},
    {"fahrrad", "fahrräder", kNeuter, "bike", "bikes"},
};
const std::vector<Noun> kReadables = {
    {"brief", "briefe", kMasculine, "letter", "letters"},
    {"zeitung", "zeitungen", kFeminine, "newspaper", "newspapers"},
    {"buch", "bücher", kNeuter, "book", "books"},
};

struct Adjective {
  std::string de_stem, en;
};
const std::vector<Adjective> kAdjectives = {
    {"klein", "small"}, {"groß", "big"},  {"alt", "old"},   {"neu", "new"},
    {"rot", "red"},     {"blau", "blue"}, {"grün", "green"}, {"schön", "beautiful"},
};

enum ObjectKind { kAnyObject, kThingObject, kPersonObject, kReadableObject };

struct Verb {
  std::string de_3sg, de_3pl, particle, de_infinitive, de_participle;
  std::string en_3sg, en_base, en_past;
  ObjectKind objects;
};
const std::vector<Verb> kVerbs = {
    {"sieht", "sehen", "", "sehen", "gesehen", "sees", "see", "saw", kAnyObject},
    {"findet", "finden", "", "finden", "gefunden", "finds", "find", "found", kAnyObject},
    {"sucht", "suchen", "", "suchen", "gesucht", "looks for", "look for", "looked for", kAnyObject},
    {"malt", "malen", "", "malen", "gemalt", "paints", "paint", "painted", kAnyObject},
    {"kauft", "kaufen", "", "kaufen", "gekauft", "buys", "buy", "bought", kThingObject},
    {"trägt", "tragen", "", "tragen", "getragen", "carries", "carry", "carried", kThingObject},
    {"bringt", "bringen", "mit", "mitbringen", "mitgebracht", "brings", "bring", "brought",
     kThingObject},
    {"liest", "lesen", "", "lesen", "gelesen", "reads", "read", "read", kReadableObject},
    {"ruft", "rufen", "an", "anrufen", "angerufen", "calls", "call", "called", kPersonObject},
    {"besucht", "besuchen", "", "besuchen", "besucht", "visits", "visit", "visited",
     kPersonObject},
};

struct Modal {
  std::string de_3sg, de_3pl, en_3sg, en_3pl;
};
const std::vector<Modal> kModals = {
    {"kann", "können", "can", "can"},
    {"muss", "müssen", "must", "must"},
    {"will", "wollen", "wants to", "want to"},
};

const std::vector<std::string> kNumbersDe = {"ein",    "zwei", "drei", "vier", "fünf", "sechs",
                                             "sieben", "acht", "neun", "zehn", "elf",  "zwölf"};
const std::vector<std::string> kNumbersEn = {"one",   "two",   "three", "four", "five",   "six",
                                             "seven", "eight", "nine",  "ten",  "eleven", "twelve"};
const std::vector<std::string> kDaysDe = {"montag",  "dienstag", "mittwoch", "donnerstag",
                                          "freitag", "samstag",  "sonntag"};
const std::vector<std::string> kDaysEn = {"monday", "tuesday",  "wednesday", "thursday",
                                          "friday", "saturday", "sunday"};

struct Phrase {
  std::string de, en;
};
const std::vector<Phrase> kPlaces = {
    {"im park", "in the park"},         {"im garten", "in the garden"},
    {"in der schule", "at school"},     {"in der küche", "in the kitchen"},
    {"auf dem markt", "at the market"}, {"im wald", "in the forest"},
    {"in der stadt", "in the city"},    {"zu hause", "at home"},
};

enum Determiner { kDefinite, kIndefinite, kDefinitePlural, kNumberPlural };

// A noun phrase in both languages; `plural` decides the verb's agreement.
struct NounPhrase {
  std::string de, en;
  bool plural = false;
};

bool starts_with_vowel(const std::string& word) {
  return !word.empty() && std::string("aeiou").find(word[0]) != std::string::npos;
}

NounPhrase make_noun_phrase(SplitMix64& rng, const Noun& noun, Case grammatical_case) {
  static const char* kDefiniteArticle[2][3] = {{"der", "die", "das"}, {"den", "die", "das"}};
  static const char* kIndefiniteArticle[2][3] = {{"ein", "eine", "ein"}, {"einen", "eine", "ein"}};
  // Adjective endings after the definite article, after the indefinite one (weak/mixed).
  static const char* kWeakEnding[2][3] = {{"e", "e", "e"}, {"en", "e", "e"}};
  static const char* kMixedEnding[2][3] = {{"er", "e", "es"}, {"en", "e", "es"}};

  const unsigned roll = static_cast<unsigned>(rng.below(100));
  const Determiner determiner = roll < 45   ? kDefinite
                                : roll < 70 ? kIndefinite
                                : roll < 85 ? kDefinitePlural
                                            : kNumberPlural;
  const Adjective* adjective = rng.chance(40) ? &rng.pick(kAdjectives) : nullptr;
  size_t number = 0;
  if (determiner == kNumberPlural) number = 1 + rng.below(kNumbersDe.size() - 1);  // zwei..zwölf

  NounPhrase phrase;
  std::string de_adjective, en_adjective;
  const int c = grammatical_case, g = noun.gender;
  switch (determiner) {
    case kDefinite:
      phrase.de = kDefiniteArticle[c][g];
      if (adjective) de_adjective = adjective->de_stem + kWeakEnding[c][g];
      phrase.en = "the";
      break;
    case kIndefinite:
      phrase.de = kIndefiniteArticle[c][g];
      if (adjective) de_adjective = adjective->de_stem + kMixedEnding[c][g];
      phrase.en = starts_with_vowel(adjective ? adjective->en : noun.en_singular) ? "an" : "a";
      break;
    case kDefinitePlural:
      phrase.de = "die";
      if (adjective) de_adjective = adjective->de_stem + "en";
      phrase.en = "the";
      phrase.plural = true;
      break;
    case kNumberPlural:
      phrase.de = kNumbersDe[number];
      if (adjective) de_adjective = adjective->de_stem + "e";
      phrase.en = kNumbersEn[number];
      phrase.plural = true;
      break;
  }
  if (adjective) {
    phrase.de += " " + de_adjective;
    phrase.en += " " + adjective->en;
  }
  phrase.de += " " + (phrase.plural ? noun.de_plural : noun.de_singular);
  phrase.en += " " + (phrase.plural ? noun.en_plural : noun.en_singular);
  return phrase;
}

const Noun& pick_object_noun(SplitMix64& rng, ObjectKind kind) {
  switch (kind) {
    case kThingObject:
      return rng.pick(kThings);
    case kPersonObject:
      return rng.pick(kPeople);
    case kReadableObject:
      return rng.pick(kReadables);
    case kAnyObject:
      break;
  }
  const size_t i = rng.below(kPeople.size() + kAnimals.size() + kThings.size());
  if (i < kPeople.size()) return kPeople[i];
  if (i < kPeople.size() + kAnimals.size()) return kAnimals[i - kPeople.size()];
  return kThings[i - kPeople.size() - kAnimals.size()];
}

Phrase make_time(SplitMix64& rng) {
  const unsigned roll = static_cast<unsigned>(rng.below(100));
  if (roll < 50) {
    const size_t day = rng.below(kDaysDe.size());
    return {"am " + kDaysDe[day], "on " + kDaysEn[day]};
  }
  if (roll < 85) {
    const size_t hour = rng.below(kNumbersDe.size());
    return {"um " + kNumbersDe[hour] + " uhr", "at " + kNumbersEn[hour] + " o'clock"};
  }
  return {"heute", "today"};
}

size_t count_words(const std::string& text) {
  size_t words = 0;
  bool in_word = false;
  for (char ch : text) {
    if (ch == ' ') {
      in_word = false;
    } else if (!in_word) {
      in_word = true;
      ++words;
    }
  }
  return words;
}

void append(std::string& sentence, const std::string& part) {
  if (part.empty()) return;
  if (!sentence.empty()) sentence += ' ';
  sentence += part;
}

enum Tense { kPresent, kWithModal, kPerfect };

// One sentence pair. German: verb second (after the subject or a fronted time), with a modal or
// the perfect the main verb goes to the end, a separable particle goes to the end. English:
// subject-verb-object, place, then time (or the time first when German fronts it).
TranslationExample make_sentence(SplitMix64& rng) {
  const size_t subject_index = rng.below(kPeople.size() + kAnimals.size());
  const Noun& subject_noun = subject_index < kPeople.size()
                                 ? kPeople[subject_index]
                                 : kAnimals[subject_index - kPeople.size()];
  const NounPhrase subject = make_noun_phrase(rng, subject_noun, kNominative);
  const Verb& verb = rng.pick(kVerbs);
  const NounPhrase object = make_noun_phrase(rng, pick_object_noun(rng, verb.objects), kAccusative);

  const unsigned tense_roll = static_cast<unsigned>(rng.below(100));
  const Tense tense = tense_roll < 50 ? kPresent : tense_roll < 75 ? kWithModal : kPerfect;
  const Modal& modal = rng.pick(kModals);
  const bool has_time = rng.chance(35);
  const bool time_first = has_time && rng.chance(50);
  const Phrase time = has_time ? make_time(rng) : Phrase{};
  const bool has_place = rng.chance(35);
  const Phrase place = has_place ? rng.pick(kPlaces) : Phrase{};

  std::string de_finite, de_final, en_verb;
  const bool plural = subject.plural;
  switch (tense) {
    case kPresent:
      de_finite = plural ? verb.de_3pl : verb.de_3sg;
      de_final = verb.particle;
      en_verb = plural ? verb.en_base : verb.en_3sg;
      break;
    case kWithModal:
      de_finite = plural ? modal.de_3pl : modal.de_3sg;
      de_final = verb.de_infinitive;
      en_verb = (plural ? modal.en_3pl : modal.en_3sg) + " " + verb.en_base;
      break;
    case kPerfect:
      de_finite = plural ? "haben" : "hat";
      de_final = verb.de_participle;
      en_verb = verb.en_past;
      break;
  }

  std::string de, en;
  if (time_first) {
    append(de, time.de);
    append(de, de_finite);
    append(de, subject.de);
  } else {
    append(de, subject.de);
    append(de, de_finite);
    if (has_time) append(de, time.de);
  }
  append(de, object.de);
  append(de, place.de);
  append(de, de_final);

  if (time_first) append(en, time.en);
  append(en, subject.en);
  append(en, en_verb);
  append(en, object.en);
  append(en, place.en);
  if (has_time && !time_first) append(en, time.en);

  return {de + " .", en + " ."};
}

}  // namespace

TranslationCorpus generate_corpus(uint64_t seed, const SplitSizes& sizes) {
  constexpr size_t kMaxGermanWords = 12;
  SplitMix64 rng(seed);
  std::unordered_set<std::string> seen_de, seen_en;
  TranslationCorpus corpus;
  std::vector<TranslationExample>* splits[] = {&corpus.train, &corpus.validation, &corpus.test};
  const size_t targets[] = {sizes.train, sizes.validation, sizes.test};
  const size_t wanted = sizes.train + sizes.validation + sizes.test;
  const size_t max_attempts = 100 * wanted + 1000;
  size_t attempts = 0;
  for (int s = 0; s < 3; ++s) {
    splits[s]->reserve(targets[s]);
    while (splits[s]->size() < targets[s]) {
      if (++attempts > max_attempts) {
        throw std::runtime_error("generate_corpus: could not find " + std::to_string(wanted) +
                                 " distinct sentences in " + std::to_string(max_attempts) +
                                 " attempts; ask for smaller splits");
      }
      TranslationExample example = make_sentence(rng);
      if (count_words(example.de) - 1 > kMaxGermanWords) continue;  // - 1: the final " ."
      if (seen_de.count(example.de) || seen_en.count(example.en)) continue;
      seen_de.insert(example.de);
      seen_en.insert(example.en);
      splits[s]->push_back(std::move(example));
    }
  }
  return corpus;
}

}  // namespace harness::data
