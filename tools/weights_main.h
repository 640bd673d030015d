// The pshard subcommands that take weights out and move checkpoints:
// layout, export, reshard, sample. Each reads its flags (the pshard
// tool's) and returns the process's exit code: 0 done, 1 failed, 2 bad
// flags.
#ifndef PSHARD_TOOLS_WEIGHTS_MAIN_H_
#define PSHARD_TOOLS_WEIGHTS_MAIN_H_

namespace pshard {

int RunLayoutCommand();
int RunExportCommand();
int RunReshardCommand();
int RunSampleCommand();

}  // namespace pshard

#endif  // PSHARD_TOOLS_WEIGHTS_MAIN_H_
