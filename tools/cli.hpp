// Subcommand registry of the dmuon CLI: each tools/*.cpp file adds its subcommand with a static
// Registration, so main.cpp never changes when a subcommand is added.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace dmuon::cli {

// Adds a subcommand to `app` (the root, or a group such as `bench`) and sets its callback.
using AddSubcommand = std::function<void(CLI::App& parent)>;

struct Registration {
  // group: "" for a top-level subcommand, or a group name ("bench") created on first use.
  Registration(std::string group, AddSubcommand add);
};

// Called by main(): adds every registered subcommand.
void add_registered_subcommands(CLI::App& app);

}  // namespace dmuon::cli
