// Source of mul_add.mlirbc (generic form: upstream mlir-opt does not know StableHLO). Regenerate with
//   /usr/lib/llvm-22/bin/mlir-opt --allow-unregistered-dialect --emit-bytecode mul_add.mlir -o mul_add.mlirbc
"func.func"() <{function_type = (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>, sym_name = "main"}> ({
^bb0(%a: tensor<4xf32>, %b: tensor<4xf32>):
  %0 = "stablehlo.multiply"(%a, %b) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  %1 = "stablehlo.add"(%0, %b) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  "func.return"(%1) : (tensor<4xf32>) -> ()
}) : () -> ()
