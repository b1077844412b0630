build/dmuon simulate --model qwen2.5-0.5b --layers 4 --profile docs/bench/this-cpu.json --devices 1,2,4 --gpus-per-node 4 --json
