#include "trainer_client/data/default_corpus.h"

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/rng.h"

namespace pshard {
namespace {

constexpr int64_t kTargetBytes = 1536 * 1024;
constexpr uint64_t kCorpusSeed = 0x70736861726431ull;  // "pshard1"

struct Noun {
  absl::string_view one, many;
};
struct Verb {
  absl::string_view base, third, past;
};

constexpr absl::string_view kNames[] = {
    "Alice", "Bob",    "Clara", "David", "Emma",  "Felix", "Grace", "Henry", "Iris", "Jack",
    "Kate",  "Leo",    "Mia",   "Noah",  "Olive", "Paul",  "Quinn", "Rosa",  "Sam",  "Tara",
    "Uma",   "Victor", "Wendy", "Yara",  "Zoe",   "Anna",  "Ben",   "Carl",  "Dora", "Eli"};

constexpr Noun kCreatures[] = {
    {"cat", "cats"},         {"dog", "dogs"},           {"bird", "birds"},
    {"horse", "horses"},     {"rabbit", "rabbits"},     {"farmer", "farmers"},
    {"teacher", "teachers"}, {"doctor", "doctors"},     {"baker", "bakers"},
    {"sailor", "sailors"},   {"goat", "goats"},         {"owl", "owls"},
    {"frog", "frogs"},       {"king", "kings"},         {"queen", "queens"},
    {"painter", "painters"}, {"student", "students"},   {"tiger", "tigers"},
    {"duck", "ducks"},       {"monkey", "monkeys"},     {"girl", "girls"},
    {"boy", "boys"},         {"neighbor", "neighbors"}, {"traveler", "travelers"}};

constexpr Noun kThings[] = {
    {"apple", "apples"},   {"book", "books"},     {"basket", "baskets"},     {"letter", "letters"},
    {"cup", "cups"},       {"lamp", "lamps"},     {"key", "keys"},           {"coin", "coins"},
    {"stone", "stones"},   {"flower", "flowers"}, {"ball", "balls"},         {"hat", "hats"},
    {"boat", "boats"},     {"candle", "candles"}, {"map", "maps"},           {"egg", "eggs"},
    {"orange", "oranges"}, {"pencil", "pencils"}, {"bottle", "bottles"},     {"shell", "shells"},
    {"cake", "cakes"},     {"drum", "drums"},     {"umbrella", "umbrellas"}, {"ring", "rings"},
    {"clock", "clocks"},   {"spoon", "spoons"},   {"blanket", "blankets"},   {"kite", "kites"}};

constexpr absl::string_view kPlaces[] = {
    "garden", "river",  "market", "forest", "kitchen", "library", "station", "village",
    "bridge", "hill",   "school", "harbor", "castle",  "field",   "barn",    "lake",
    "tower",  "square", "bakery", "meadow", "cave",    "island",  "road",    "museum"};

constexpr absl::string_view kAdjectives[] = {
    "small",  "big",  "old",    "young",  "quiet",  "happy",  "tired",   "clever",  "brave",
    "gentle", "lazy", "bright", "dark",   "heavy",  "tiny",   "strange", "famous",  "hungry",
    "proud",  "shy",  "warm",   "cold",   "little", "busy",   "careful", "curious", "friendly",
    "green",  "red",  "blue",   "yellow", "white",  "golden", "wooden"};

constexpr absl::string_view kColors[] = {"red",   "blue",  "green", "yellow", "white",
                                         "black", "brown", "grey",  "orange", "purple"};

constexpr Verb kTransitive[] = {
    {"find", "finds", "found"},     {"carry", "carries", "carried"}, {"see", "sees", "saw"},
    {"bring", "brings", "brought"}, {"hold", "holds", "held"},       {"lose", "loses", "lost"},
    {"open", "opens", "opened"},    {"paint", "paints", "painted"},  {"buy", "buys", "bought"},
    {"sell", "sells", "sold"},      {"drop", "drops", "dropped"},    {"hide", "hides", "hid"},
    {"take", "takes", "took"},      {"give", "gives", "gave"},       {"wash", "washes", "washed"},
    {"fix", "fixes", "fixed"},      {"want", "wants", "wanted"},     {"like", "likes", "liked"},
    {"keep", "keeps", "kept"},      {"throw", "throws", "threw"},    {"read", "reads", "read"},
    {"make", "makes", "made"},      {"count", "counts", "counted"},  {"love", "loves", "loved"}};

constexpr Verb kIntransitive[] = {
    {"sleep", "sleeps", "slept"},   {"run", "runs", "ran"},           {"sing", "sings", "sang"},
    {"wait", "waits", "waited"},    {"dance", "dances", "danced"},    {"walk", "walks", "walked"},
    {"laugh", "laughs", "laughed"}, {"swim", "swims", "swam"},        {"rest", "rests", "rested"},
    {"sit", "sits", "sat"},         {"play", "plays", "played"},      {"jump", "jumps", "jumped"},
    {"work", "works", "worked"},    {"listen", "listens", "listened"}};

constexpr absl::string_view kPrepositions[] = {"near",   "behind",     "under", "beside",
                                               "inside", "across",     "above", "around",
                                               "beyond", "in front of"};

constexpr absl::string_view kAdverbs[] = {"quickly",   "slowly", "quietly", "happily",
                                          "carefully", "loudly", "gently",  "again",
                                          "together",  "alone",  "early",   "late"};

constexpr absl::string_view kTimes[] = {
    "in the morning", "at noon",   "in the evening", "at night",      "on Monday",
    "on Tuesday",     "on Friday", "on Sunday",      "every day",     "after lunch",
    "before dinner",  "last week", "in the spring",  "in the winter", "yesterday"};

constexpr absl::string_view kNumbers[] = {"zero", "one",    "two",   "three", "four",
                                          "five", "six",    "seven", "eight", "nine",
                                          "ten",  "eleven", "twelve"};

// Deterministic choices: the i-th draw is CounterHash(seed, stream, i).
class Chooser {
 public:
  int Below(int n) {
    const uint64_t hash = CounterHash(kCorpusSeed, /*stream=*/0, counter_++);
    return static_cast<int>((static_cast<unsigned __int128>(hash) * static_cast<uint64_t>(n)) >>
                            64);
  }
  bool Chance(int percent) { return Below(100) < percent; }
  template <typename U, size_t N>
  const U& Pick(const U (&items)[N]) {
    return items[Below(static_cast<int>(N))];
  }

 private:
  uint64_t counter_ = 0;
};

absl::string_view Article(absl::string_view word) {
  return absl::string_view("aeiou").find(word.front()) != absl::string_view::npos ? "an" : "a";
}

// What a paragraph is about: sentences reuse these, so later sentences can
// be predicted from earlier ones.
struct Topic {
  absl::string_view name, friend_name, place;
  Noun creature, thing;
};

// Appends one sentence about `topic`, without trailing space. Every draw is
// its own statement: the order of evaluation of function arguments is
// unspecified, and the corpus must not depend on the compiler.
void AppendSentence(Chooser& rng, const Topic& topic, std::string& out) {
  const absl::string_view place = rng.Chance(60) ? topic.place : rng.Pick(kPlaces);
  const Noun& thing = rng.Chance(50) ? topic.thing : rng.Pick(kThings);
  switch (rng.Below(11)) {
    case 0: {
      const absl::string_view adj = rng.Pick(kAdjectives);
      const absl::string_view verb = rng.Pick(kTransitive).past;
      const absl::string_view prep = rng.Pick(kPrepositions);
      absl::StrAppend(&out, "The ", adj, " ", topic.creature.one, " ", verb, " the ", thing.one,
                      " ", prep, " the ", place, ".");
      break;
    }
    case 1: {
      const absl::string_view verb = rng.Pick(kTransitive).past;
      const int count = 2 + rng.Below(11);
      const absl::string_view time = rng.Pick(kTimes);
      absl::StrAppend(&out, topic.name, " ", verb, " ", kNumbers[count], " ", thing.many, " ", time,
                      ".");
      break;
    }
    case 2: {
      const absl::string_view verb = rng.Pick(kIntransitive).past;
      const absl::string_view prep = rng.Pick(kPrepositions);
      absl::StrAppend(&out, topic.name, " and ", topic.friend_name, " ", verb, " ", prep, " the ",
                      place, ".");
      break;
    }
    case 3: {
      const absl::string_view prep = rng.Pick(kPrepositions);
      absl::StrAppend(&out, "Where is the ", thing.one, "? The ", thing.one, " is ", prep, " the ",
                      place, ".");
      break;
    }
    case 4: {
      const absl::string_view verb = rng.Pick(kTransitive).base;
      const absl::string_view adj = rng.Pick(kAdjectives);
      absl::StrAppend(&out, topic.name, " said, \"I ", verb, " ", Article(adj), " ", adj, " ",
                      thing.one, ".\"");
      break;
    }
    case 5: {
      const Verb& verb = rng.Pick(kIntransitive);
      const absl::string_view other = rng.Pick(kCreatures).one;
      absl::StrAppend(&out, "If the ", topic.creature.one, " ", verb.third, ", the ", other, " ",
                      verb.third, " too.");
      break;
    }
    case 6: {
      const int a = rng.Below(50);
      const int b = rng.Below(50);
      absl::StrAppend(&out, topic.name, " knows that ", a, " plus ", b, " is ", a + b, ".");
      break;
    }
    case 7: {
      const int count = 2 + rng.Below(5);
      absl::StrAppend(&out, topic.friend_name, " counted the ", thing.many, ":");
      for (int i = 1; i <= count; ++i) {
        absl::StrAppend(&out, " ", kNumbers[i], i < count ? "," : ".");
      }
      break;
    }
    case 8: {
      const absl::string_view color = rng.Pick(kColors);
      const absl::string_view other = rng.Pick(kThings).one;
      const absl::string_view other_color = rng.Pick(kColors);
      absl::StrAppend(&out, "The ", thing.one, " is ", color, ", and the ", other, " is ",
                      other_color, ".");
      break;
    }
    case 9: {
      const Verb& verb = rng.Pick(kTransitive);
      absl::StrAppend(&out, "What did ", topic.name, " ", verb.base, "? ", topic.name, " ",
                      verb.past, " the ", thing.one, ".");
      break;
    }
    default: {
      const int day = 1 + rng.Below(30);
      const int price = 1 + rng.Below(20);
      const absl::string_view adverb = rng.Pick(kAdverbs);
      absl::StrAppend(&out, "On day ", day, ", ", topic.name, " went to the ", place,
                      " and bought ", Article(thing.one), " ", thing.one, " for ", price,
                      price == 1 ? " coin " : " coins ", adverb, ".");
      break;
    }
  }
}

}  // namespace

std::string DefaultCorpus() {
  Chooser rng;
  std::string out;
  out.reserve(kTargetBytes + 4096);
  while (static_cast<int64_t>(out.size()) < kTargetBytes) {
    Topic topic;
    topic.name = rng.Pick(kNames);
    do {
      topic.friend_name = rng.Pick(kNames);
    } while (topic.friend_name == topic.name);
    topic.place = rng.Pick(kPlaces);
    topic.creature = rng.Pick(kCreatures);
    topic.thing = rng.Pick(kThings);
    const int sentences = 3 + rng.Below(5);
    for (int s = 0; s < sentences; ++s) {
      if (s > 0) out.push_back(' ');
      AppendSentence(rng, topic, out);
    }
    out.push_back('\n');
  }
  return out;
}

}  // namespace pshard
