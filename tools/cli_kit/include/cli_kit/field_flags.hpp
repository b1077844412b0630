// The library names a bad option by its field ("TrainOptions.micro_batches must be at least 1"); the
// command line names it by the flag that sets it ("--micro-batches must be at least 1").
#pragma once

#include <string>
#include <string_view>

namespace dmuon::cli {

// The flag of a TrainOptions field: "micro_batches" → "--micro-batches", "save_dir" → "--save",
// "model.width" → "--width".
std::string train_flag(std::string_view field);

// `text` with each "TrainOptions.<field>" and "GptConfig.<field>" replaced by train_flag(field),
// "OptimizerStackOptions.kind" by "--optim" and "TuneSessionOptions.cache_path" by "--tune-cache".
std::string with_flags(const std::string& text);

}  // namespace dmuon::cli
