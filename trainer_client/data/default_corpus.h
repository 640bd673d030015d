// A built-in training text, so the demo trains without downloading anything.
#ifndef PSHARD_TRAINER_CLIENT_DATA_DEFAULT_CORPUS_H_
#define PSHARD_TRAINER_CLIENT_DATA_DEFAULT_CORPUS_H_

#include <string>

namespace pshard {

/// A deterministic, generated English-like corpus of about 1.5 MB: paragraphs
/// of sentences from a small grammar over a few hundred words, with
/// punctuation, quoted speech, questions and answers that repeat earlier
/// words, counting and small sums. A small GPT learns it well below its
/// unigram entropy within a few hundred steps. The same bytes on every call
/// and platform (pure function, no global state); takes tens of milliseconds.
std::string DefaultCorpus();

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_DATA_DEFAULT_CORPUS_H_
