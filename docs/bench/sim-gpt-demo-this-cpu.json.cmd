build/dmuon simulate --gpt demo --profile docs/bench/this-cpu.json --devices 1,2,4 --gpus-per-node 4 --json
