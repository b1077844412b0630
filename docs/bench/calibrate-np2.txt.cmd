mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 build/dmuon bench calibrate --model qwen2.5-0.5b --layers 4 --out docs/bench/this-cpu.json
